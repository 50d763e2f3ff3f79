"""Engine benchmark over gRPC, as TGI's benchmark tool does: a shard process driven directly.

Prefill latency per batch size and prompt length; decode latency per step and tokens/s per batch
size, after a warm-up, with percentiles; and the shard's resident memory once its model is loaded
(before the KV cache is allocated). Prints tables; writes JSON with --json.

    python benchmarks/engine_bench.py [--model-dir DIR] [--dtype bfloat16] [--batch-sizes 1,2,4,...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import generate_pb2 as pb  # noqa: E402
from proto import generate_pb2_grpc as pb_grpc  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


class ShardDriver:
    """Allocates blocks itself (block 0 reserved) and speaks the proto to one shard."""

    def __init__(self, stub, block_size: int, num_blocks: int, vocab_size: int):
        self.stub = stub
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))
        self.next_id = 0
        self.token_span = min(1000, vocab_size - 10)  # ids 10.. inside any vocabulary

    def batch(self, batch_size: int, prompt_length: int, new_tokens: int,
              adapters: Sequence[str | None] = ()) -> tuple[pb.Batch, list]:
        """Request i on LoRA adapter adapters[i % len(adapters)] (None: the base model); all on
        the base model when `adapters` is empty."""
        requests, held = [], []
        for i in range(batch_size):
            count = -(-(prompt_length + new_tokens) // self.block_size)
            blocks = [self.free.pop() for _ in range(count)]
            held.append(blocks)
            requests.append(pb.Request(
                id=self.next_id, input_ids=[(7 * i + self.next_id) % self.token_span + 10
                                            for i in range(prompt_length)],
                parameters=pb.NextTokenChooserParameters(),
                stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=new_tokens,
                                                                  ignore_eos_token=True),
                blocks=blocks, skip_special_tokens=True,
                adapter_id=adapters[i % len(adapters)] if adapters else None))
            self.next_id += 1
        self.next_id += 1
        return pb.Batch(id=self.next_id, requests=requests, size=batch_size), held

    def release(self, held: list) -> None:
        for blocks in held:
            self.free.extend(blocks)


async def run_prefill(driver: ShardDriver, batch_size: int, prompt_length: int, repeats: int,
                      adapters: Sequence[str | None] = ()):
    latencies = []
    for _ in range(repeats):
        batch, held = driver.batch(batch_size, prompt_length, 2, adapters)
        started = time.perf_counter()
        reply = await driver.stub.Prefill(pb.PrefillRequest(batch=batch))
        latencies.append(time.perf_counter() - started)
        _check_admitted(reply, batch_size)
        await driver.stub.ClearCache(pb.ClearCacheRequest(id=reply.batch.id))
        driver.release(held)
    return latencies


async def run_decode(driver: ShardDriver, batch_size: int, prompt_length: int, steps: int,
                     warmup: int, adapters: Sequence[str | None] = ()):
    batch, held = driver.batch(batch_size, prompt_length, steps + warmup + 1, adapters)
    reply = await driver.stub.Prefill(pb.PrefillRequest(batch=batch))
    _check_admitted(reply, batch_size)
    cached = reply.batch
    latencies = []
    for step in range(steps + warmup):
        started = time.perf_counter()
        reply = await driver.stub.Decode(pb.DecodeRequest(batches=[cached]))
        if step >= warmup:
            latencies.append(time.perf_counter() - started)
        cached = reply.batch
    await driver.stub.ClearCache(pb.ClearCacheRequest(id=cached.id))
    driver.release(held)
    return latencies


def _check_admitted(reply, batch_size: int) -> None:
    """A shard that refused the requests would time nothing."""
    if reply.rejected or len(reply.generations) != batch_size:
        raise RuntimeError(f"the shard computed {len(reply.generations)} of {batch_size} "
                           f"requests: {[r.reason for r in reply.rejected][:3]}")


def start_shard(model_dir: Path, dtype: str, socket_prefix: str,
                quantize: str = "", compile_decode: bool = False, device: str = "auto",
                cuda_graphs: str = "0", kv_cache_dtype: str = "") -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "shard", "--model-path", str(model_dir),
                                "--uds-path", socket_prefix, "--dtype", dtype,
                                "--quantize", quantize, "--device", device,
                                "--compile-decode", str(int(compile_decode)),
                                "--cuda-graphs", cuda_graphs, "--kv-cache-dtype", kv_cache_dtype],
                               cwd=Path(__file__).resolve().parents[1],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not os.path.exists(f"{socket_prefix}-0"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"shard did not start: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    return process


def resident_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def bench(args) -> dict:
    socket_prefix = os.path.join(tempfile.mkdtemp(), "bench")
    shard = start_shard(args.model_dir, args.dtype, socket_prefix, args.quantize,
                        args.compile_decode, args.device, args.cuda_graphs, args.kv_cache_dtype)
    try:
        channel = grpc.aio.insecure_channel(f"unix://{socket_prefix}-0")
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(pb.InfoRequest())
        loaded_mib = resident_mib(shard.pid)
        longest = max(*args.prompt_lengths, args.decode_prompt)
        # room for the largest decode batch and the largest prefill batch alike
        per_request = longest + args.steps + args.warmup + 64
        tokens = max(*args.batch_sizes, *args.prefill_batch_sizes) * per_request
        # max_total_tokens: the longest request, which sizes the widest CUDA graph
        warm = await stub.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0), max_input_tokens=1,
                                                  max_prefill_tokens=1,
                                                  max_total_tokens=per_request,
                                                  max_batch_total_tokens=tokens))
        vocab_size = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
        driver = ShardDriver(stub, info.block_size, warm.num_blocks, vocab_size)
        results = {"device": info.device_type, "dtype": info.dtype, "quantize": args.quantize,
                   "compile_decode": args.compile_decode, "cuda_graphs": args.cuda_graphs,
                   "kv_cache_dtype": args.kv_cache_dtype or info.dtype,
                   "num_blocks": warm.num_blocks, "decode_prompt": args.decode_prompt,
                   "resident_mib_after_load": loaded_mib,
                   "prefill": [], "decode": []}
        await run_decode(driver, 1, 16, 4, 2)  # process warm-up
        for prompt_length in args.prompt_lengths:
            for batch_size in args.prefill_batch_sizes:
                lat = await run_prefill(driver, batch_size, prompt_length, args.prefill_repeats)
                results["prefill"].append({"batch": batch_size, "prompt": prompt_length,
                                           "latency_s": summary(lat),
                                           "tokens_per_s": batch_size * prompt_length /
                                           statistics.median(lat)})
        for batch_size in args.batch_sizes:
            lat = await run_decode(driver, batch_size, args.decode_prompt, args.steps, args.warmup)
            results["decode"].append({"batch": batch_size, "latency_s": summary(lat),
                                      "tokens_per_s": batch_size / statistics.median(lat)})
        await channel.close()
        return results
    finally:
        shard.terminate()
        shard.wait(timeout=30)


def print_tables(results: dict) -> None:
    print(f"device {results['device']}, dtype {results['dtype']}"
          + (f", weights {results['quantize']}" if results.get('quantize') else "")
          + (", compiled decode step" if results.get("compile_decode") else "")
          + (f", KV cache {results['kv_cache_dtype']}" if results.get("kv_cache_dtype") else "")
          + (f", CUDA graphs {results['cuda_graphs']}"
             if results["device"] == "cuda" and results.get("cuda_graphs", "0") != "0" else "")
          + f", resident after load {results['resident_mib_after_load']:.0f} MiB")
    print(f"\n{'prefill':<8}{'batch':>6}{'prompt':>8}{'p50 ms':>10}{'p90 ms':>10}{'tok/s':>10}")
    for row in results["prefill"]:
        lat = row["latency_s"]
        print(f"{'':<8}{row['batch']:>6}{row['prompt']:>8}{lat['p50'] * 1e3:>10.1f}"
              f"{lat['p90'] * 1e3:>10.1f}{row['tokens_per_s']:>10.0f}")
    print(f"\ndecode steps after {results.get('decode_prompt', 128)}-token prompts")
    print(f"{'decode':<8}{'batch':>6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'tok/s':>10}")
    for row in results["decode"]:
        lat = row["latency_s"]
        print(f"{'':<8}{row['batch']:>6}{lat['p50'] * 1e3:>10.1f}{lat['p90'] * 1e3:>10.1f}"
              f"{lat['p99'] * 1e3:>10.1f}{row['tokens_per_s']:>10.1f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--compile-decode", action="store_true",
                        help="the shard compiles its decode step at warm-up (see "
                             "shard/decode_paths/compiled.py)")
    parser.add_argument("--quantize", default="", choices=["", "int8", "int4"],
                        help="weight-only quantization of the shard's linear layers")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--kv-cache-dtype", default="", choices=["", "int8"],
                        help="int8: the shard's 8-bit KV cache (the shard's flag); empty: the "
                             "model's dtype")
    parser.add_argument("--cuda-graphs", default="0",
                        help="batch sizes the shard captures CUDA graphs for (the shard's flag; "
                             "0: eager steps); compare 0 with 1,2,4,8,16,32 on a GPU")
    parser.add_argument("--batch-sizes", type=_ints, default=_ints("1,2,4,8,16,32,64"))
    parser.add_argument("--prefill-batch-sizes", type=_ints, default=_ints("1,4"))
    parser.add_argument("--prompt-lengths", type=_ints, default=_ints("128,512"))
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model_dir is None:
        from launcher.prepare import prepare_default_model

        args.model_dir = prepare_default_model(dtype="float32")
    results = asyncio.run(bench(args))
    print_tables(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
