"""The shard process's settings (imported by the launcher too, so it must not import torch)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")

# The environment variables a shard reads, all read here (docs/operations.md lists them)
CACHE_ENV = "TGI_PY_CACHE"
# builds the C kernels for this -march instead of the host's (e.g. x86-64-v3: as an AVX2-only CPU
# builds them, to run that form on a newer CPU)
KERNEL_MARCH_ENV = "TGI_PY_KERNEL_MARCH"
# the launcher's ledger of the CPU KV pools its shard groups hold (shard/kv_budget.py's PoolLedger)
KV_LEDGER_ENV = "TGI_PY_KV_LEDGER"
# every C kernel off: their PyTorch equivalents run instead (TGI's flag for its custom kernels)
DISABLE_KERNELS_ENV = "DISABLE_CUSTOM_KERNELS"
# glibc's own malloc settings: a person who set any has chosen, and the shard leaves glibc's
# allocator alone
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
              "MALLOC_MMAP_MAX_", "LD_PRELOAD")


def cache_root() -> Path:
    """Where prepared models, downloads, the registry and built kernels live.

    TGI_PY_CACHE, else ~/.cache/tgi-py."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tgi-py").expanduser()


def kernel_enabled(switch_env: str) -> bool:
    """A C kernel's switch (TGI_PY_MATMUL_KERNEL, TGI_PY_INT4_KERNEL, ...).

    On unless "0", or unless DISABLE_CUSTOM_KERNELS (TGI's variable, set by the launcher's
    --disable-custom-kernels) turns every one off."""
    if os.environ.get(DISABLE_KERNELS_ENV, "").lower() in ("1", "true", "yes"):
        return False
    return os.environ.get(switch_env, "1") != "0"


def kernel_march() -> str | None:
    return os.environ.get(KERNEL_MARCH_ENV) or None


def c_compiler() -> str:
    return os.environ.get("CC", "cc")


def kv_ledger_dir() -> Path | None:
    directory = os.environ.get(KV_LEDGER_ENV)
    return Path(directory) if directory else None


def local_topology(config: "ShardConfig") -> tuple[int, int]:
    """(this rank's index, ranks) on this machine.

    Across machines the global rank is not this machine's GPU index (the launcher says which)."""
    return (int(os.environ.get("LOCAL_RANK", config.rank)),
            int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)))


def log_level() -> str:
    """LOG_LEVEL (the launcher passes its own on): INFO unless set."""
    return os.environ.get("LOG_LEVEL", "INFO").upper()


def malloc_set_by_hand() -> bool:
    """Whether the environment sets glibc's malloc.

    By its variables, its tunables, or a preloaded allocator."""
    return (any(name in os.environ for name in MALLOC_ENV)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
# shard.layers.quantize's, on the CPU, and shard.layers.fp8's, anywhere (this module must not
# import torch)
QUANTIZE_KINDS = ("int8", "int4", "fp8")
CPU_QUANTIZE_KINDS = ("int8", "int4")
KV_CACHE_DTYPES = ("int8",)  # besides the model's own: shard.layers.kv_int8
# --cuda-graphs not given: batch sizes up to the largest decode batch the router may form, chosen
# at warm-up (shard.decode_paths.cuda_graphs.auto_batch_sizes)
AUTO_CUDA_GRAPHS = "auto"


def cpu_has_avx2() -> bool:
    """x86 CPUs with AVX2 (AVX-512 ones included), from /proc/cpuinfo's flags."""
    return "avx2" in cpu_flags().split()


def device_refusal(device: str, *, quantize: str | None = None,
                   kv_cache_dtype: str | None = None) -> str | None:
    """Why --quantize or --kv-cache-dtype cannot run on `device` (a device type), or None.

    int8 and int4 weights run CPU kernels only (fp8 weights run anywhere); an int8 KV cache is
    read by the C kernels on the CPU and Triton's on CUDA (the shard checks that Triton's run:
    shard.kernels.decode_backend.cache_refusal). "auto" passes: the shard chooses the CPU for
    --quantize int8/int4, and asks again once it knows its device."""
    if device in ("cpu", "auto"):
        return None
    if quantize in CPU_QUANTIZE_KINDS:
        return (f"--quantize {quantize} runs CPU kernels only, not on {device}: serve on the "
                "CPU (--device cpu, or auto on a machine without a GPU) or without --quantize")
    if kv_cache_dtype in KV_CACHE_DTYPES and device != "cuda":  # the model's dtype runs anywhere
        return (f"--kv-cache-dtype {kv_cache_dtype} is read by the CPU's and CUDA's kernels "
                f"only, not on {device}: serve on the CPU (--device cpu), on CUDA, or without "
                "--kv-cache-dtype")
    return None


def decode_path_refusal(kv_cache_dtype: str | None, *, compile_decode: bool,
                        cuda_graphs: bool = False) -> str | None:
    """Why the chosen decode paths cannot read a KV cache of `kv_cache_dtype`, or None.

    Neither the compiled decode step nor a CUDA graph that gathers each context reads an int8
    cache's scales (`cuda_graphs`: such graphs are captured; graphs over Triton's kernel, which
    reads them, are not refused)."""
    if kv_cache_dtype in KV_CACHE_DTYPES and (compile_decode or cuda_graphs):
        return (f"--kv-cache-dtype {kv_cache_dtype} with --compile-decode or CUDA graphs: "
                "neither the compiled decode step nor a captured graph reads the cache's scales; "
                "leave one of them out")
    return None


def parse_cuda_graphs(text: str) -> list[int] | str:
    """`--cuda-graphs`: comma-separated batch sizes, 0 (or nothing) for none, or AUTO_CUDA_GRAPHS."""
    if text.strip() == AUTO_CUDA_GRAPHS:
        return AUTO_CUDA_GRAPHS
    try:
        sizes = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        raise ValueError(f"--cuda-graphs {text!r} is not a comma-separated list of batch "
                         "sizes") from None
    if sizes in ([], [0]):
        return []
    if sizes[0] < 1:
        raise ValueError(f"--cuda-graphs {text!r}: batch sizes are at least 1 (0 alone turns "
                         "CUDA graphs off)")
    return sizes


def default_dtype(device_type: str, model_path: str | Path) -> str:
    """The dtype of a shard started without --dtype, once its device is known.

    CUDA: float16 (TGI's default there), or bfloat16 for a checkpoint stored in bfloat16 (the
    shard takes float16 instead on a GPU without bf16 arithmetic).
    CPU: bfloat16 where the CPU has AVX2: bf16 weights and KV cache were faster than float32 on
    every x86 CPU measured (benchmarks/RESULTS.md), where the C bf16 matmul (its AVX-512 BF16 or
    its AVX2 form) and the C decode step run, and also with float32 arithmetic on the bf16 values
    (AVX2 without a C compiler); float32 on other CPUs and devices, where nothing was measured.
    An encoder (BERT) on the CPU: float32. It only ever runs prompt-sized matmuls, which are
    compute-bound, and bf16's were no faster than float32's there (benchmarks/RESULTS.md); float32
    also keeps sentence-transformers' answers exactly."""
    if device_type == "cpu" and _is_encoder(model_path):
        return "float32"
    if device_type == "cuda":
        config = json.loads((Path(model_path) / "config.json").read_text())
        stored = config.get("torch_dtype") or config.get("dtype")
        return "bfloat16" if stored == "bfloat16" else "float16"
    if device_type == "cpu" and cpu_has_avx2():
        return "bfloat16"
    return "float32"


def _is_encoder(model_path: str | Path) -> bool:
    from shard.models import ENCODERS

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return any(name in ENCODERS for name in json.loads(config.read_text()).get("architectures")
               or [])


@dataclass(slots=True)
class ShardConfig:
    model_path: str = field(metadata={"help": "Local model directory (config.json, *.safetensors, "
                                              "tokenizer.json)."})
    uds_path: str = field(default="/tmp/tgi-py-server", metadata={
        "help": "Unix socket prefix; rank r listens on <uds_path>-<r>."})
    dtype: str = field(default="", metadata={
        "help": f"Weights and KV dtype: {DTYPES}; empty: the device's default (default_dtype)."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto (cuda when available)."})
    quantize: str = field(default="", metadata={
        "help": "Weight-only quantization of the linear layers on the CPU: int8 or int4 "
                "(empty: none)."})
    kv_cache_dtype: str = field(default="", metadata={
        "help": "int8: keys and values cached as int8 with a float32 scale per token and KV head "
                "(CPU only, not with --compile-decode); empty: the model's dtype."})
    grpc_address: str = field(default="", metadata={
        "help": "Also serve on this TCP host:port, the address the router reaches this rank at "
                "from another machine (tensor parallelism across machines); empty: the unix "
                "socket alone."})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block."})
    compile_decode: int = field(default=0, metadata={
        "help": "1: compile the decode step (torch.compile, inductor's C++ backend on the CPU) "
                "at warm-up; 0: eager."})
    cuda_graphs: str = field(default=AUTO_CUDA_GRAPHS, metadata={
        "help": "Batch sizes to capture the decode step in CUDA graphs for at warm-up "
                "(comma-separated; 0: none; auto: up to the largest decode batch the warm-up "
                "allows). CUDA only."})
    speculate: int = field(default=0, metadata={
        "help": "Draft tokens (n-gram, from the request's own text) verified per request and "
                "decode step; 0: no speculation."})
    memory_fraction: float = field(default=1.0, metadata={
        "help": "Share of the device's memory the server may use, when the router does not fix the "
                "KV pool's size (the launcher's --cuda-memory-fraction; see shard/kv_budget.py)."})
    otlp_endpoint: str = field(default=None, metadata={
        "help": "OTLP gRPC endpoint to export trace spans to (unset: no tracing)."})
    otlp_service_name: str = field(default="tgi-py.shard", metadata={
        "help": "service.name of the exported spans."})
    rope_scaling: str = field(default="", metadata={
        "help": "linear: override the checkpoint's rope scaling with a linear one of --rope-factor "
                "(the launcher's --rope-scaling/--rope-factor); empty: the checkpoint's own."})
    rope_factor: float = field(default=1.0, metadata={
        "help": "Factor of --rope-scaling linear; the model's context grows by as much."})
    watermark_gamma: float = field(default=0.5, metadata={
        "help": "Share of the vocabulary on each green list of the watermark."})
    watermark_delta: float = field(default=2.0, metadata={
        "help": "What the watermark adds to each green token's logit."})
    rank: int = field(default=0, metadata={"help": "Tensor-parallel rank (env RANK)."})
    world_size: int = field(default=1, metadata={"help": "Tensor-parallel world size (env WORLD_SIZE)."})
    master_addr: str = field(default="127.0.0.1", metadata={"help": "Rendezvous address (env MASTER_ADDR)."})
    master_port: int = field(default=29500, metadata={"help": "Rendezvous port (env MASTER_PORT)."})

    def __post_init__(self):
        if self.dtype not in ("", *DTYPES):
            raise ValueError(f"--dtype {self.dtype!r} is not one of {DTYPES}")
        if self.quantize not in ("", *QUANTIZE_KINDS):
            raise ValueError(f"--quantize {self.quantize!r} is not one of {QUANTIZE_KINDS}")
        if self.speculate < 0:
            raise ValueError(f"--speculate {self.speculate} must be at least 0")
        if self.kv_cache_dtype not in ("", *KV_CACHE_DTYPES):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of "
                             f"{KV_CACHE_DTYPES} (or empty: the model's dtype)")
        refusal = device_refusal(self.device, kv_cache_dtype=self.kv_cache_dtype)
        if refusal is not None:
            raise ValueError(refusal)
        refusal = decode_path_refusal(self.kv_cache_dtype, compile_decode=self.compile_decode)
        if refusal is not None:
            raise ValueError(refusal)
        parse_cuda_graphs(self.cuda_graphs)  # a bad list fails at start, not at warm-up
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"--memory-fraction {self.memory_fraction} must be above 0 and at "
                             "most 1")
        if self.block_size < 1:
            raise ValueError(f"--block-size {self.block_size} must be at least 1")
        if self.rope_scaling not in ("", "linear") or self.rope_factor <= 0:
            raise ValueError(f"--rope-scaling {self.rope_scaling!r} --rope-factor "
                             f"{self.rope_factor}: linear (or nothing) and a factor above 0")
        if not 0 < self.watermark_gamma < 1 or self.watermark_delta < 0:
            raise ValueError(f"--watermark-gamma {self.watermark_gamma} must be between 0 and 1 "
                             f"and --watermark-delta {self.watermark_delta} at least 0")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")

    def rope_override(self) -> dict | None:
        """The rope scaling that replaces the checkpoint's, in config.json's form; None: none."""
        if not self.rope_scaling:
            return None
        return {"rope_type": self.rope_scaling, "factor": self.rope_factor}

    @property
    def socket_path(self) -> str:
        return f"{self.uds_path}-{self.rank}"

    def to_argv(self) -> list[str]:
        argv = []
        for f in fields(self):
            if f.name in _ENV_FIELDS:
                continue
            argv += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return argv


_ENV_FIELDS = {"rank": "RANK", "world_size": "WORLD_SIZE", "master_addr": "MASTER_ADDR",
               "master_port": "MASTER_PORT"}


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    parser = argparse.ArgumentParser(prog="tgi-shard", description="Serve one model shard over gRPC.")
    for f in fields(ShardConfig):
        flag = f"--{f.name.replace('_', '-')}"
        default = os.environ.get(_ENV_FIELDS[f.name], f.default) if f.name in _ENV_FIELDS \
            else f.default
        required = default is dataclasses.MISSING
        parser.add_argument(flag, type=_type(f), required=required,
                            default=None if required else default, help=f.metadata.get("help"))
    args = parser.parse_args(argv)
    return ShardConfig(**vars(args))


def _type(f):
    return {"int": int, "float": float}.get(f.type, str)
