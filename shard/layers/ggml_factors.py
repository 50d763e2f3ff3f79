"""A GGUF type's factors as stored, for the kernels' compact modes.

Float16 scales, or a superblock's scale times 6-bit ones. The float32 (scale, low) per group of ggml_quants.Groups costs 2 bits a weight at groups of 32 and
4 at 16: a third more than a Q4_K_M file holds. The kernels' compact modes keep each type's own
factors instead and compute scale and low from them in float32, as the `gguf` package does, so
the weights are the same bit for bit:
- "half": a float16 scale and low per group of 32 (Q4_0, Q4_1, Q5_1; Q8_0 and Q5_0 have no low);
- "k": a superblock's float32 d and dmin per 256 inputs and 6-bit sc and m per 32: scale d * sc,
  low -(dmin * m) (Q4_K, Q5_K);
- "k6": a superblock's d and a signed 8-bit sc per 16 inputs: scale d * sc, no low (Q6_K).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.layers import ggml_quants as gq


@dataclass(frozen=True, slots=True)
class CompactFactors:
    """Rows of one type as q [rows, columns] int16 and their factors in `mode`'s fields."""
    mode: str  # "half", "k" or "k6"
    q: torch.Tensor
    fields: dict  # the mode's tensors, each [rows, columns / its span]


def _per_row(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return tensor.reshape(rows, -1).contiguous()


def compact_factors(rows: gq.BlockRows) -> CompactFactors | None:
    """The rows' own factors, or None where they do not fit a compact mode.

    None: a float16 low of Q4_0's -8d that overflows."""
    kind, data = rows.kind, rows.data
    groups = rows.groups()
    count = data.shape[0]
    blocks = data.reshape(-1, gq.BLOCK_TYPES[kind].block_bytes)
    if kind in ("Q4_K", "Q5_K"):
        sc, mins = gq.scale_min(blocks[:, 4:16])
        fields = {"d": _per_row(gq.half(blocks, 0), count), "sc": _per_row(sc, count),
                  "dmin": _per_row(gq.half(blocks, 2), count), "m": _per_row(mins, count)}
        return CompactFactors("k", groups.q, fields)
    if kind == "Q6_K":
        sc = blocks[:, 192:208].contiguous().view(torch.int8)
        fields = {"d": _per_row(gq.half(blocks, 208), count), "sc": _per_row(sc, count)}
        return CompactFactors("k6", groups.q, fields)
    scale = blocks[:, 0:2].contiguous().view(torch.float16)
    if kind in ("Q4_1", "Q5_1"):
        low = blocks[:, 2:4].contiguous().view(torch.float16)
        return CompactFactors("half", groups.q, {"scale": _per_row(scale, count),
                                                 "low": _per_row(low, count)})
    if kind == "Q8_0":
        return CompactFactors("half", groups.q, {"scale": _per_row(scale, count)})
    # Q4_0 and Q5_0: q - 8 (- 16) times d, signed for the int8 form, or q with a low of -8d
    offset = {"Q4_0": 8, "Q5_0": 16}[kind]
    low = scale * -offset
    if not torch.isfinite(low).all():
        return None
    if kind == "Q5_0":
        return CompactFactors("half", groups.q - offset, {"scale": _per_row(scale, count)})
    return CompactFactors("half", groups.q, {"scale": _per_row(scale, count),
                                             "low": _per_row(low, count)})
