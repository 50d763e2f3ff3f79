"""The sampling rows' draw on CUDA in Triton: hashed noise and the exponential race in one launch.

shard.sampling_noise's PyTorch form takes some twenty launches over [rows, vocab], each writing a
tensor of that size (the hash's rounds, the uniform, its logarithm, the ratio, the argmax); here
one program a row reads its log-probabilities once and keeps the running best. The same hash
(noise_hash.mix32) of the same (seed key, position, token id): the same noise to the last
bit, the float32 arithmetic after it to an ulp. Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.noise_hash import MASK, MIX, UNIFORM_BITS, WEYL

BLOCK = 1024  # token ids a program scores at once
_MIX = tl.constexpr(MIX)


@triton.jit
def _mix32(x, mask):
    x = ((x >> 16) ^ x) * _MIX & mask
    x = ((x >> 16) ^ x) * _MIX & mask
    return (x >> 16) ^ x


@triton.jit
def _race(logprobs_ptr, keys_ptr, positions_ptr, rows_ptr, out_ptr, vocab, stride_row, mask,
          weyl, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, UNIFORM_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    row_key = _mix32(key ^ (position & mask), mask)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_id = tl.zeros([BLOCK], tl.int64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = ids < vocab
        logprob = tl.load(logprobs_ptr + row * stride_row + ids, mask=inside,
                          other=float("-inf"))
        x = _mix32((row_key + ids * weyl) & mask, mask) >> (32 - UNIFORM_BITS)
        uniform = (x.to(tl.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
        score = tl.where(inside, tl.exp(logprob) / -tl.log(uniform), -1.0)
        better = score > best  # strictly: each lane keeps its first best, as argmax does
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_id, vocab), 0))


def draw(logprobs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
         rows: torch.Tensor | None, greedy_ids: torch.Tensor) -> torch.Tensor:
    """sampling_noise.draw's contract in one launch: greedy_ids with the `rows` drawn."""
    if logprobs.stride(1) != 1 or logprobs.dtype != torch.float32:
        logprobs = logprobs.float().contiguous()
    out = greedy_ids.clone()
    programs = logprobs.shape[0] if rows is None else rows.shape[0]
    if programs:
        _race[(programs,)](logprobs, keys, positions, keys if rows is None else rows, out,
                           logprobs.shape[1], logprobs.stride(0), MASK, WEYL,
                           HAS_ROWS=rows is not None, BLOCK=BLOCK, UNIFORM_BITS=UNIFORM_BITS)
    return out
