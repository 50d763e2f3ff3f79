"""The int8 form of the KV cache (`--kv-cache-dtype int8`): int8 rows with a float32 scale each.

Each cached row (one token's key or value for one kv head) is stored as int8 with its scale
beside it, written where keys and values are stored and read back here for PyTorch's attention
(the C kernel reads the int8 rows itself).

A row x of d values is stored as q = round(x / s) with s = max|x| / 127 (symmetric; a zero row has
s = 0 and q = 0) and stands for q * s: each value within s / 2 of x, that is within max|x| / 254.
"""
from __future__ import annotations

import torch

QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in int8 with their scales: x [..., d] -> (int8 [..., d], float32 scales [...]).

    The arithmetic is float32 (a bf16 x is widened exactly), each value divided by its row's scale
    and rounded to nearest even, as the C writes (layer_ops.c) do, so both write the same bytes."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1) / QMAX
    # a zero row: 0 / 0 would be NaN; its values are all 0
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.round(wide / divisor).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [..., d] and scales [...] -> float32 [..., d]: what the rows stand for."""
    return q.float() * scale.unsqueeze(-1)


def store_rows(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
               slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """The int8 cache write of x [T, kv_heads, d] at (slot_blocks[t], slot_offsets[t]).

    x is quantized into cache [blocks, kv_heads, block_size, d] (int8) and scales
    [blocks, kv_heads, block_size]."""
    q, scale = quantize_rows(x)
    cache[slot_blocks, :, slot_offsets] = q
    scales[slot_blocks, :, slot_offsets] = scale


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor,
                       index: torch.Tensor) -> torch.Tensor:
    """Each sequence's context read back from the int8 cache as float32 [B, kv_heads, L, d].

    L is blocks * block_size: the rows `index` [B, kv_heads, blocks] of the flattened cache, as
    shard.layers.attention_state.gather_blocks reads them, dequantized."""
    _, _, block_size, head_dim = cache.shape
    batch, num_kv_heads, needed = index.shape
    flat = index.reshape(-1)
    rows = cache.view(-1, block_size * head_dim).index_select(0, flat)
    row_scales = scales.view(-1, block_size).index_select(0, flat)
    out = rows.view(-1, block_size, head_dim).float() * row_scales.unsqueeze(-1)
    return out.view(batch, num_kv_heads, needed * block_size, head_dim)
