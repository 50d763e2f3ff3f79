"""`tgi-shard`: load one tensor-parallel rank of a model and serve it over gRPC on a unix socket."""
from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
import torch

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.launcher_watch import watch_launcher
from proto.logs import configure_logging, is_json_output, log_source
from proto.tracing import init_tracing, shutdown_tracing
from shard import convert, watermark
from shard.config import (AUTO_CUDA_GRAPHS, CPU_QUANTIZE_KINDS, ShardConfig, default_dtype,
                          device_refusal, local_topology, log_level, parse_args,
                          parse_cuda_graphs)
from shard.distributed import all_gather_strings, init_parallel
from shard.embedder import Embedder
from shard.engine import Engine
from shard.kv_budget import KVCacheSpec, PoolLedger
from shard.layers.embedding import ParallelLMHead
from shard.layers.precision import c_matmul_runs
from shard.loader import load_model
from shard.malloc_tuning import MMAP_THRESHOLD, keep_freed_memory, return_freed_memory
from shard.model_runner import ModelRunner
from shard.pooling import read_pooling
from shard.quantization_report import describe
from shard.server import ShardServicer, engine_thread

log = logging.getLogger("tgi.shard")


async def loop_run(worker, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)


def build_engine(config: ShardConfig) -> tuple[Engine, Embedder, pb.InfoResponse, list[str]]:
    """The engine, its embedder, its Info, and where the router reaches each rank (rank order)."""
    # across machines the global rank is not this machine's GPU index (the launcher says which)
    device = _device(config)
    parallel = init_parallel(rank=config.rank, world_size=config.world_size,
                             master_addr=config.master_addr, master_port=config.master_port,
                             device=device)
    dtype_name = config.dtype or _default_dtype(config, device, parallel)
    dtype = getattr(torch, dtype_name)
    # asked again now that the device is known: --device auto may have found a GPU
    refusal = device_refusal(device.type, quantize=config.quantize,
                             kv_cache_dtype=config.kv_cache_dtype)
    if refusal is not None:
        raise ValueError(refusal)
    loaded = load_model(Path(config.model_path), dtype=dtype, device=device, parallel=parallel,
                        quantize=config.quantize or None, rope_scaling=config.rope_override())
    log.info("rank %d loaded %s as %s (%s on %s)", config.rank, config.model_path,
             loaded.architecture, dtype_name, device)
    if config.rope_scaling:
        log.info("rope scaling %s, factor %s (the launcher's --rope-scaling): context %d",
                 config.rope_scaling, config.rope_factor, loaded.config.max_position_embeddings)
    watermark.configure(watermark.WatermarkSettings(config.watermark_gamma,
                                                    config.watermark_delta))
    quantize = config.quantize or None
    if quantize == "fp8" and loaded.quantization_config:  # an FP8 checkpoint, served as it comes
        quantize = None
    if quantize:
        _log_quantized(loaded.model, quantize, dtype_name)
    quantization = describe(loaded.model, loaded.quantization_config, quantize)
    if quantization and not quantize:
        log.info("weights served as stored: %s", quantization)
    return_freed_memory()
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, loaded.heads.num_kv_heads, cfg.head_dim,
                       config.block_size, dtype, device, int8=config.kv_cache_dtype == "int8")
    if spec.int8:
        log.info("KV cache: int8 with a float32 scale per token and KV head, %d bytes a block "
                 "(%d in %s)", spec.bytes_per_block,
                 dataclasses.replace(spec, int8=False).bytes_per_block, dtype_name)
    cuda_graphs = parse_cuda_graphs(config.cuda_graphs)
    if cuda_graphs and device.type != "cuda" and cuda_graphs != AUTO_CUDA_GRAPHS:
        log.warning("--cuda-graphs %s: CUDA graphs are captured on CUDA devices only; this shard "
                    "runs on the %s", config.cuda_graphs, device.type)
    runner = ModelRunner(loaded.model, spec, compile_decode=bool(config.compile_decode),
                         world_size=config.world_size, cuda_graphs=cuda_graphs)
    engine = Engine(loaded, runner, memory_fraction=config.memory_fraction,
                    world_size=config.world_size, speculate=config.speculate,
                    ledger=PoolLedger.from_environment(config.uds_path))
    model_dir = Path(config.model_path)
    pooling = read_pooling(model_dir, json.loads((model_dir / "config.json").read_text()))
    max_embed = min(cfg.max_position_embeddings, pooling.max_seq_length or 1 << 31)
    embedder = Embedder(loaded.model, spec, pooling, engine.vocab_size, max_embed)
    if pooling.declared:
        log.info("embeddings: %s pooling%s, inputs of up to %d tokens", pooling.mode or "no",
                 ", normalized" if pooling.normalize else "", max_embed)
    info = pb.InfoResponse(
        requires_padding=False, dtype=dtype_name, device_type=device.type,
        speculate=config.speculate,
        support_chunking=True, use_prefix_caching=True, attention_impl="paged-sdpa",
        block_size=config.block_size, model_id=config.model_path, world_size=config.world_size,
        eos_token_ids=sorted(loaded.eos_token_ids),
        max_position_embeddings=cfg.max_position_embeddings, hidden_size=cfg.hidden_size,
        vocab_size=engine.vocab_size, architecture=loaded.architecture,
        quantization=quantization, **convert.image_fields(engine.images),
        generates=not embedder.is_encoder, pooling=pooling.mode, normalize=pooling.normalize,
        declares_embedding=pooling.declared or embedder.is_encoder,
        matryoshka=pooling.matryoshka, matryoshka_dimensions=pooling.matryoshka_dimensions,
        max_embed_tokens=max_embed, max_adapter_bytes=runner.adapters.largest_files_bytes())
    # ranks on other machines are reached over TCP; each says where, the others learn it here
    urls = all_gather_strings(config.grpc_address or f"unix://{config.socket_path}", parallel)
    return engine, embedder, info, urls


def _device(config: ShardConfig) -> torch.device:
    """This rank's device (on CPUs shared by several ranks, its share of the threads too)."""
    local_rank, local_ranks = local_topology(config)
    if config.device == "auto":
        # the int8/int4 kernels are CPU ones: they keep an automatic choice on the CPU
        use_cuda = torch.cuda.is_available() and config.quantize not in CPU_QUANTIZE_KINDS
        device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    else:
        device = torch.device(f"cuda:{local_rank}" if config.device == "cuda" else config.device)
    if device.type == "cuda" and local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {config.rank} would run on cuda:{local_rank}, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible to it: as many shards "
                         "on this machine as GPUs, or --device cpu")
    if device.type == "cpu" and config.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the cores; more threads than cores makes every all-reduce wait on a straggler
        # (a count given, such as a model's cpu_threads, is torch's already)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return device


def _log_quantized(model: torch.nn.Module, quantize: str, dtype_name: str) -> None:
    """How many layers took the quantized form, and whether any multiplies by it here."""
    layers = [m.prepared for m in model.modules() if hasattr(m, "prepared")
              if not (quantize == "fp8" and isinstance(m, ParallelLMHead))]  # kept on purpose
    done = sum(p.quantized is not None for p in layers)
    log.info("%s weights: %d of %d linear layers quantized", quantize, done, len(layers))
    if done and not any(p.multiplies_quantized for p in layers):
        log.warning("PyTorch's %s kernels are no faster here than the unquantized path (%s): "
                    "the layers multiply by the weights the %s forms stand for (the quantized "
                    "model's answers, not its speed)", quantize,
                    "our bf16 matmul runs here, and the C decode step where it applies"
                    if c_matmul_runs()
                    else "this CPU has no bf16 kernels: AVX-512, AVX-NE-CONVERT",
                    quantize)
    if done < len(layers):  # int4 takes input features by 32 and output features by 16
        log.warning("%d linear layers keep %s weights: their shape does not fit the %s kernel",
                    len(layers) - done, dtype_name, quantize)


def _default_dtype(config: ShardConfig, device: torch.device, parallel) -> str:
    """The device's default dtype (no --dtype given), the same on every rank.

    Ranks on machines whose defaults differ would exchange activations of different dtypes."""
    dtype_name = default_dtype(device.type, config.model_path)
    if (dtype_name == "bfloat16" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 0)):
        dtype_name = "float16"  # GPUs before Ampere emulate bf16 (is_bf16_supported says yes)
    chosen = all_gather_strings(dtype_name, parallel)
    if len(set(chosen)) > 1:
        raise ValueError(f"the ranks' default dtypes differ ({', '.join(chosen)} in rank order): "
                         "pass --dtype")
    log.info("no --dtype: %s, the default on this machine's %s", dtype_name, device.type)
    return dtype_name


async def serve(config: ShardConfig) -> None:
    # ends this process (with SIGTERM, whose handler below stops it in order) once tgi-launcher
    # is gone; while the model loads, before that handler exists, SIGTERM just ends it
    watch_launcher()
    init_tracing(config.otlp_service_name, config.otlp_endpoint)
    loop = asyncio.get_running_loop()
    worker = engine_thread()
    engine, embedder, info, urls = await loop_run(worker, build_engine, config)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_fatal_error(err: Exception) -> None:
        log.error("the shard cannot go on (its device or its ranks' group failed), stopping: %s",
                  err)
        stop.set()

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2**31 - 1),
                                      ("grpc.max_send_message_length", 2**31 - 1)])
    pb_grpc.add_TextGenerationServiceServicer_to_server(
        ShardServicer(engine, config, info, on_fatal_error, worker, urls, embedder), server)
    socket = config.socket_path
    if os.path.exists(socket):
        os.unlink(socket)
    server.add_insecure_port(f"unix://{socket}")
    if config.grpc_address:
        server.add_insecure_port(config.grpc_address)
    await server.start()
    log.info("shard %d/%d serving %s (%s, %s) on unix://%s%s", config.rank, config.world_size,
             config.model_path, info.dtype, info.device_type, socket,
             f" and {config.grpc_address}" if config.grpc_address else "")
    try:
        await stop.wait()
    finally:
        await server.stop(grace=1.0)
        if os.path.exists(socket):
            os.unlink(socket)
        shutdown_tracing()
        log.info("shard %d stopped", config.rank)


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's stack: how to see where a stuck process is
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_logging(log_level(), json_output=is_json_output(), source=log_source("shard"))
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"tgi-shard: {err}", file=sys.stderr)
        return 2
    if keep_freed_memory():
        log.info("glibc keeps freed memory for reuse (mmap threshold %d MiB)",
                 MMAP_THRESHOLD // 2**20)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
