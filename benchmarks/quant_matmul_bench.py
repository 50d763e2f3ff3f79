"""Our int4 and int8 kernels on GGUF's types at Llama 3 8B's layer shapes, against another revision.

For Q4_K (shard/kernels/int4_matmul.c, mode K), Q6_K and Q8_0 (int8_matmul.c, modes K6 and H), on
random blocks of the 4096x4096 (q, o), 14336x4096 (gate, up) and 4096x14336 (down) weights: the
median time of the kernel as this checkout builds it and as `--baseline` (a git revision) built it,
in turns, at each row count, in GFLOP/s (2 m n k over the time). Both take the same packed buffer
(the packing did not change).

    python benchmarks/matmul_bench.py --gguf [--baseline main] [--rows 1,8,32,128,512]
"""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from shard.kernels import bf16_matmul, int4_matmul, int8_matmul, native

ROOT = Path(__file__).resolve().parents[1]
# output features x input features
SHAPES = {"q_o": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}
KINDS = ("Q4_K", "Q6_K", "Q8_0")


def _baseline(revision: str, source: Path, flags: list[str], symbol: str):
    """The kernel function `symbol` of `source` (and the headers beside it) at `revision`."""
    folder = Path(tempfile.mkdtemp(prefix="baseline-kernels-"))
    relative = source.relative_to(ROOT).parent
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{relative}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{revision}:{relative}/{name}"], cwd=ROOT,
                                  capture_output=True, check=True).stdout
            (folder / name).write_bytes(text)
    built = folder / f"{source.stem}.so"
    flags = native.build_flags(flags)
    subprocess.run(["gcc", *flags, str(folder / source.name), "-o", str(built)], check=True)
    kernel = getattr(ctypes.CDLL(str(built)), symbol)
    kernel.argtypes = bf16_matmul.MATMUL_ARGTYPES
    kernel.restype = ctypes.c_int
    return kernel


def _packed(kind: str, n: int, k: int) -> torch.Tensor:
    """Random blocks of a GGUF type, packed as the loader packs them."""
    supers, groups = k // 256, k // 32
    if kind == "Q4_K":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, supers) * 1e-3).half().float()
        dmin = (torch.rand(n, supers) * 1e-3).half().float()
        sc, m = (torch.randint(0, 64, (n, groups), dtype=torch.uint8) for _ in range(2))
        return int4_matmul.pack_k(q, d, sc, dmin, m)
    if kind == "Q6_K":
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
        d = (torch.rand(n, supers) * 1e-3).half().float()
        sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
        return int8_matmul.pack_k6(q, d, sc)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return int8_matmul.pack_half(q, (torch.rand(n, groups) * 1e-2).half(), 32)


def run(args, median_ms) -> None:
    """Print a table: kind, shape, rows, baseline and current GFLOP/s, and their ratio."""
    current = {"int4": int4_matmul.load_library().int4_matmul,
               "int8": int8_matmul.load_library().int8_matmul}
    baseline = {"int4": _baseline(args.baseline, int4_matmul.SOURCE, int4_matmul.FLAGS,
                                  "int4_matmul"),
                "int8": _baseline(args.baseline, int8_matmul.SOURCE, int8_matmul.FLAGS,
                                  "int8_matmul")}
    march = native.kernel_march() or "native"
    print(f"# -march={march}, {torch.get_num_threads()} threads, baseline {args.baseline}")
    print(f"{'kind':6} {'shape':8} {'rows':>5} {'baseline':>9} {'current':>9} {'ratio':>6}")
    kinds = [kind for kind in args.kinds.split(",") if kind]
    for kind in kinds:
        library = "int4" if kind == "Q4_K" else "int8"
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            packed = _packed(kind, n, k)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                flops = 2 * rows * n * k
                times = {"baseline": [], "current": []}
                for _ in range(args.rounds):
                    for name, kernel in (("baseline", baseline[library]),
                                         ("current", current[library])):
                        times[name].append(median_ms(
                            lambda kernel=kernel: bf16_matmul.run_on_rows(kernel, x, packed, n,
                                                                          None), args.budget))
                rates = {name: flops / min(t) / 1e6 for name, t in times.items()}
                print(f"{kind:6} {shape:8} {rows:5d} {rates['baseline']:9.1f} "
                      f"{rates['current']:9.1f} {rates['current'] / rates['baseline']:6.2f}",
                      flush=True)
