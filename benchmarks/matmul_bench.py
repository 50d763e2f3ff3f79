"""Our C bf16 matmul against PyTorch's matmuls, on SmolLM2-135M's linear shapes, in one process.

For each shape and row count, the median time of: our kernel (shard/kernels/bf16_matmul.c, in the
form this CPU builds, or for `--march`, e.g. x86-64-v3 for the AVX2 form an AVX2-only CPU builds);
F.linear on a float32 copy of the weight (what AVX2 CPUs without the kernel run for prefill sizes);
and oneDNN's prepacked bf16 matmul where oneDNN has bf16 kernels. The three run in turns, round
after round, so a noisy machine slows them alike.

    python benchmarks/matmul_bench.py [--march x86-64-v3] [--rows 1,8,32,128,1024,4096]

`--step` times instead the matmuls of a whole decode step of the 30 decoder layers (q/k/v, output,
gate/up, down; 212 MB of distinct bf16 weights, more than any cache, so streamed from memory as in
serving) through our bf16 kernel and, where it runs, our int4 kernel (shard/kernels/int4_matmul.c),
in turns:

    python benchmarks/matmul_bench.py --step --rows 1,2,4,8,16

`--gguf` times instead our int4 and int8 kernels on GGUF's Q4_K, Q6_K and Q8_0 at Llama 3 8B's
layer shapes, against the same kernels at another revision (benchmarks/quant_matmul_bench.py):

    python benchmarks/matmul_bench.py --gguf --baseline main --rows 1,8,32,128,512
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
    parser.add_argument("--step", action="store_true",
                        help="a decode step's matmuls of 30 layers, bf16 against int4")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--gguf", action="store_true",
                        help="int4 / int8 kernels on GGUF types at 8B shapes, against --baseline")
    parser.add_argument("--baseline", default="main", help="git revision (--gguf)")
    parser.add_argument("--kinds", default="Q4_K,Q6_K,Q8_0", help="GGUF types (--gguf)")
    args = parser.parse_args()
    if args.march:
        os.environ["TGI_PY_KERNEL_MARCH"] = args.march
    from shard.kernels import bf16_matmul
    from shard.layers import precision
    if args.step:
        return step(args)
    if args.gguf:
        from benchmarks import quant_matmul_bench
        if args.shapes == ",".join(SHAPES):
            args.shapes = ",".join(quant_matmul_bench.SHAPES)
        return quant_matmul_bench.run(args, _median_ms)

    library = bf16_matmul.load_library()
    if library is None:
        sys.exit("the C bf16 matmul does not build here (no C compiler, or no AVX2 / AVX-512 BF16)")
    form = {bf16_matmul.DPBF16_FORM: "AVX-512 BF16", bf16_matmul.AVX2_FORM: "AVX2"}[
        library.bf16_matmul_supported()]
    onednn = precision.cpu_has_bf16_kernels()
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
        packed, wide = bf16_matmul.pack(weight), weight.float()
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if onednn else None
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            xf = x.float()
            runs = {"ours": lambda: bf16_matmul.matmul(x, packed, n, None),
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


def step(args) -> None:
    from shard.kernels import bf16_matmul, int4_matmul

    if bf16_matmul.load_library() is None:
        sys.exit("the C bf16 matmul does not build here")
    four = int4_matmul.load_library() is not None
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            n, k = SHAPES[name]
            weight = torch.randn(n, k) * k ** -0.5
            layers.append((n, k, bf16_matmul.pack(weight.bfloat16()),
                           int4_matmul.pack(*int4_matmul.quantize(weight)) if four else None))
    print(f"{args.layers} layers' decode matmuls, ms (best of {args.rounds * 3} alternated)")
    print("| rows | bf16 | int4 | int4 / bf16 |" if four else "| rows | bf16 |")
    print("|---|---|---|---|" if four else "|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}

        def run(int4: bool) -> float:
            start = time.perf_counter()
            for n, k, packed, packed4 in layers:
                if int4:
                    int4_matmul.matmul(inputs[k], packed4, n, None)
                else:
                    bf16_matmul.matmul(inputs[k], packed, n, None)
            return (time.perf_counter() - start) * 1e3

        kinds = (False, True) if four else (False,)
        times = {kind: [] for kind in kinds}
        for _ in range(args.rounds * 3):
            for kind in kinds:
                times[kind].append(run(kind))
        bf16 = min(times[False])
        if four:
            int4 = min(times[True])
            print(f"| {rows} | {bf16:.2f} | {int4:.2f} | {int4 / bf16:.2f} |", flush=True)
        else:
            print(f"| {rows} | {bf16:.2f} |", flush=True)


if __name__ == "__main__":
    main()
