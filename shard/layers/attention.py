"""Paged attention: keys and values live in fixed-size blocks; each sequence reads its own through a block table.

The new tokens' keys and values are written to their slots first. Decode then attends, for the whole
batch at once, over every sequence's context gathered from the cache. Prefill attends sequence by
sequence: a fresh prompt uses its own keys with a causal kernel, a prompt that continues cached tokens
(prefix hit or later chunk) reads its context from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillLayout:
    """Where each sequence's new tokens sit in the flat batch (host-side lists, one entry per sequence)."""

    query_starts: list[int]  # flat index of each sequence's first new token; one extra at the end
    cached_lens: list[int]  # tokens of the sequence already in the cache before this forward


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward sit in the batch and in the KV cache."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (padding repeats a valid id)
    max_context_len: int
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_context_len], decode only
    prefill: PrefillLayout | None = None  # prefill only


@dataclass(slots=True)
class LayerCache:
    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] -> attention output [T, heads * d]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    gqa = num_heads != num_kv_heads
    if meta.prefill is not None:
        return _prefill_attention(q, k, v, cache, meta, scale, gqa)
    batch = meta.block_tables.shape[0]
    # context: [B, kv_heads, max_context_len, d]
    keys = _gather_context(cache.key, meta.block_tables, meta.max_context_len)
    values = _gather_context(cache.value, meta.block_tables, meta.max_context_len)
    out = F.scaled_dot_product_attention(q.view(batch, 1, num_heads, head_dim).transpose(1, 2),
                                         keys, values, attn_mask=meta.decode_mask, scale=scale,
                                         enable_gqa=gqa)
    return out.view(num_tokens, num_heads * head_dim)


def _prefill_attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float,
                       gqa: bool) -> torch.Tensor:
    layout = meta.prefill
    num_heads, head_dim = q.shape[1], q.shape[2]
    outputs = []
    for b, cached in enumerate(layout.cached_lens):
        start, end = layout.query_starts[b], layout.query_starts[b + 1]
        queries = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if cached == 0:
            keys = k[start:end].transpose(0, 1).unsqueeze(0)
            values = v[start:end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            context = cached + end - start
            table = meta.block_tables[b:b + 1]
            keys = _gather_context(cache.key, table, context)
            values = _gather_context(cache.value, table, context)
            # query i sits at position cached + i and sees keys 0..cached + i
            query_pos = torch.arange(cached, context, device=q.device).unsqueeze(1)
            mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                                 enable_gqa=gqa)
        outputs.append(out.squeeze(0).transpose(0, 1).reshape(end - start, num_heads * head_dim))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _gather_context(blocks: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = blocks.shape
    needed = -(-length // block_size)
    gathered = blocks[block_tables[:, :needed]].view(batch, needed * block_size, num_kv_heads,
                                                     head_dim)
    return gathered[:, :length].transpose(1, 2)
