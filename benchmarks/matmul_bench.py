"""Our C bf16 matmul against PyTorch's matmuls, on SmolLM2-135M's linear shapes, in one process.

For each shape and row count, the median time of: our kernel (shard/kernels/bf16_matmul.c, in the
form this CPU builds, or for `--march`, e.g. x86-64-v3 for the AVX2 form an AVX2-only CPU builds);
F.linear on a float32 copy of the weight (what AVX2 CPUs without the kernel run for prefill sizes);
and oneDNN's prepacked bf16 matmul where oneDNN has bf16 kernels. The three run in turns, round
after round, so a noisy machine slows them alike.

    python benchmarks/matmul_bench.py [--march x86-64-v3] [--rows 1,8,32,128,1024,4096]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# hidden 576, 9 heads of 64 over 3 key/value heads, intermediate 1536, vocabulary 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _median_ms(fn, budget_s: float) -> float:
    fn()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", default="", help="build the kernel for this -march")
    parser.add_argument("--rows", default="1,8,32,128,1024,4096")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    args = parser.parse_args()
    if args.march:
        os.environ["TGI_PY_KERNEL_MARCH"] = args.march
    from shard.layers import arithmetic, matmul_kernel

    library = matmul_kernel.load_library()
    if library is None:
        sys.exit("the C bf16 matmul does not build here (no C compiler, or no AVX2 / AVX-512 BF16)")
    form = {matmul_kernel.DPBF16_FORM: "AVX-512 BF16", matmul_kernel.AVX2_FORM: "AVX2"}[
        library.bf16_matmul_supported()]
    onednn = arithmetic.cpu_has_bf16_kernels()
    print(f"kernel form: {form}; threads: {torch.get_num_threads()}; oneDNN bf16: "
          f"{'yes' if onednn else 'no'}")
    header = "| shape | rows | ours ms | float32 F.linear ms | ours / float32 |"
    if onednn:
        header += " oneDNN bf16 ms | ours / oneDNN |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = torch.randn(n, k, dtype=torch.bfloat16) * k ** -0.5
        packed, wide = matmul_kernel.pack(weight), weight.float()
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if onednn else None
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            xf = x.float()
            runs = {"ours": lambda: matmul_kernel.matmul(x, packed, n, None),
                    "float32": lambda: F.linear(xf, wide)}
            if onednn:
                runs["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
                    x, prepacked, None, "none", [], "")
            times = {key: [] for key in runs}
            for _ in range(args.rounds):
                for key, fn in runs.items():
                    times[key].append(_median_ms(fn, args.budget))
            best = {key: min(value) for key, value in times.items()}
            line = (f"| {name} {n}x{k} | {rows} | {best['ours']:.3f} | {best['float32']:.3f} | "
                    f"{best['ours'] / best['float32']:.2f} |")
            if onednn:
                line += f" {best['onednn']:.3f} | {best['ours'] / best['onednn']:.2f} |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
