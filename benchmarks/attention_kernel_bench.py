"""The CPU decode-attention kernel alone (shard/kernels/paged_attention.c), as a decode step calls it.

One call per layer over that layer's own cache, so every call reads keys and values that are not in
the CPU's caches, as in a step where the weights pass in between. Prints, per batch size and context
length, the time per call and per step (all layers) and the bytes of keys and values read per second.

    python benchmarks/attention_kernel_bench.py [--shapes 1x160,32x160,32x512,8x2048] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.kernels import paged_attention  # noqa: E402


def measure(batch: int, context: int, *, layers: int, heads: int, kv_heads: int, head_dim: int,
            block_size: int, dtype: torch.dtype, rounds: int) -> float:
    """Best seconds per call over `rounds` passes through every layer."""
    blocks_per_sequence = -(-context // block_size)
    # twice the blocks the batch needs, each sequence's scattered over the pool
    num_blocks = 2 * batch * blocks_per_sequence + 1
    shape = (num_blocks, kv_heads, block_size, head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    order = torch.randperm(num_blocks - 1) + 1
    tables = order[:batch * blocks_per_sequence].view(batch, blocks_per_sequence)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    evict = torch.empty(64 * 1024 * 1024 // 4)  # larger than the last-level cache
    best = float("inf")
    for i in range(rounds):
        evict.fill_(i)
        started = time.perf_counter()
        for key, value in caches:
            paged_attention.paged_decode_attention(q, key, value, tables, lens, head_dim ** -0.5)
        best = min(best, (time.perf_counter() - started) / layers)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x160,8x160,32x160,32x512,8x2048",
                        help="batch x context length, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    # SmolLM2-135M's attention: 30 layers, 9 query heads over 3 key/value heads of 64 dims
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if paged_attention.load_kernel() is None:
        raise SystemExit("the kernel is not available here (no C compiler, or switched off)")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(f"decode attention kernel, {args.dtype} cache, {args.heads} heads over {args.kv_heads} "
          f"key/value heads of {args.head_dim} dims, {args.layers} layers, block {args.block_size}")
    for spec in args.shapes.split(","):
        batch, context = (int(x) for x in spec.split("x"))
        seconds = measure(batch, context, layers=args.layers, heads=args.heads,
                          kv_heads=args.kv_heads, head_dim=args.head_dim,
                          block_size=args.block_size, dtype=dtype, rounds=args.rounds)
        read = batch * context * args.kv_heads * args.head_dim * 2 * dtype.itemsize  # keys, values
        print(f"  batch {batch:3d}, context {context:5d}: {seconds * 1e6:8.1f} us a call, "
              f"{seconds * args.layers * 1e3:6.2f} ms a step, {read / seconds / 1e9:5.1f} GB/s "
              "of keys and values")


if __name__ == "__main__":
    main()
