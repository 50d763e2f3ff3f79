"""This machine's own limits, and what they allow the default model: memory read bandwidth and float32
multiply-add throughput (benchmarks/machine_limits.c, built for this CPU), on one thread and on all,
then the floor they set for a decode step (the weights it reads / bandwidth) and for a prefill (its
multiply-adds / throughput), to set our measured figures against.

    python benchmarks/machine_limits.py [--model-dir DIR] [--buffer-mb 1024] [--json out.json]

A decode step reads every linear layer's weight once and the whole head (the vocabulary x hidden
matrix): bf16 holds 2 bytes a weight; `--quantize int4` holds GGUF's Q4_1 form for the layers (0.75
bytes a weight: 4 bits and a float32 scale and minimum a group of 32) and a bf16 head (the int8 head's
values, widened where the CPU has no int8 kernel of ours). A prefill of T tokens does 2 x (the layers'
weights) float32 operations a token, and the head's once a prompt; attention over 128 tokens adds
about 2% (ignored: a floor). That floor is bf16's where bf16 is multiplied in float32 (AVX2); int4's
integer tiles on AVX2 and AVX-512 BF16's dot products are not bound by float32 multiply-adds.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels import native  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "machine_limits.c"
FLAGS = ["-O2", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def load() -> ctypes.CDLL:
    library = native.load_library(SOURCE, FLAGS, "TGI_PY_MACHINE_LIMITS", "no figures")
    if library is None:
        raise SystemExit("machine_limits.c did not build (a C compiler with OpenMP is needed)")
    library.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    library.read_sum.restype = ctypes.c_float
    library.fma_work.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                 ctypes.POINTER(ctypes.c_float)]
    library.fma_work.restype = ctypes.c_double
    return library


def best_of(fn, repeats: int) -> tuple[float, float]:
    """The best and the median time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def read_bandwidth(library, buffer: torch.Tensor, threads: int, repeats: int) -> dict:
    fn = lambda: library.read_sum(buffer.data_ptr(), buffer.numel(), threads)  # noqa: E731
    fn()
    best, median = best_of(fn, repeats)
    size = buffer.numel() * 4
    return {"threads": threads, "best_gb_s": size / best / 1e9, "median_gb_s": size / median / 1e9}


def fma_throughput(library, threads: int, repeats: int, rounds: int) -> dict:
    sink = ctypes.c_float(0)
    flops = [0.0]

    def fn():
        flops[0] = library.fma_work(rounds, threads, 1.0, ctypes.byref(sink))

    fn()
    best, median = best_of(fn, repeats)
    return {"threads": threads, "best_gflop_s": flops[0] / best / 1e9,
            "median_gflop_s": flops[0] / median / 1e9}


def model_shape(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    per_layer = (hidden * heads * head_dim + 2 * hidden * kv * head_dim + heads * head_dim * hidden
                 + 3 * hidden * inter)
    return {"layer_weights": per_layer * cfg["num_hidden_layers"],
            "head_weights": cfg["vocab_size"] * hidden}


def floors(shape: dict, bandwidth_gb_s: float, gflop_s: float, prompt: int, wave: int) -> dict:
    layers, head = shape["layer_weights"], shape["head_weights"]
    step_bytes = {"bf16": 2 * (layers + head), "int4": 0.75 * layers + 2 * head}
    prefill_flops = wave * (prompt * 2 * layers + 2 * head)
    total_s = prefill_flops / (gflop_s * 1e9)
    return {
        "decode_step_mb": {k: v / 1e6 for k, v in step_bytes.items()},
        "decode_step_floor_ms": {k: v / (bandwidth_gb_s * 1e9) * 1e3 for k, v in step_bytes.items()},
        "wave": {"prompts": wave, "prompt_tokens": prompt, "tflop": prefill_flops / 1e12,
                 "all_prefilled_s": total_s,
                 # prompts finishing one after another: the median one is done about halfway
                 "ttft_p50_floor_s": total_s * (wave // 2 + 0.5) / wave},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="default: SmolLM2-135M-Instruct, prepared by the launcher")
    parser.add_argument("--buffer-mb", type=int, default=1024,
                        help="the buffer read (far larger than any cache)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fma-rounds", type=int, default=20_000_000,
                        help="rounds of 12 vector multiply-adds a thread")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--wave", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    library = load()
    cpus = os.cpu_count() or 1
    buffer = torch.ones(args.buffer_mb * (1 << 20) // 4, dtype=torch.float32)
    counts = sorted({1, cpus})
    reads = [read_bandwidth(library, buffer, t, args.repeats) for t in counts]
    fmas = [fma_throughput(library, t, args.repeats, args.fma_rounds) for t in counts]
    print(f"{cpus} CPUs; read of {args.buffer_mb} MiB, best (median) of {args.repeats}:")
    for r in reads:
        print(f"  {r['threads']} thread(s): {r['best_gb_s']:.1f} GB/s ({r['median_gb_s']:.1f})")
    print("float32 multiply-adds, best (median):")
    for f in fmas:
        print(f"  {f['threads']} thread(s): {f['best_gflop_s']:.0f} GFLOP/s "
              f"({f['median_gflop_s']:.0f})")
    results = {"cpus": cpus, "read": reads, "fma": fmas}
    if args.model_dir is None:
        from launcher.prepare import prepare_default_model
        args.model_dir = prepare_default_model()
    shape = model_shape(args.model_dir)
    limit = floors(shape, reads[-1]["best_gb_s"], fmas[-1]["best_gflop_s"], args.prompt_tokens,
                   args.wave)
    results.update(model=args.model_dir.name, **shape, floors=limit)
    print(f"{args.model_dir.name}: {shape['layer_weights'] / 1e6:.1f}M layer weights, "
          f"{shape['head_weights'] / 1e6:.1f}M in the head")
    for kind, mb in limit["decode_step_mb"].items():
        print(f"  decode step, {kind}: reads {mb:.0f} MB -> at least "
              f"{limit['decode_step_floor_ms'][kind]:.2f} ms at {reads[-1]['best_gb_s']:.1f} GB/s")
    wave = limit["wave"]
    print(f"  {wave['prompts']} prompts of {wave['prompt_tokens']} tokens: {wave['tflop']:.2f} "
          f"TFLOP -> all prefilled in at least {wave['all_prefilled_s']:.2f} s, TTFT p50 at least "
          f"{wave['ttft_p50_floor_s']:.2f} s at {fmas[-1]['best_gflop_s']:.0f} GFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
