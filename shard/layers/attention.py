"""Paged attention: keys and values live in fixed-size blocks; each sequence reads its own through a block table.

One path serves prefill, chunked prefill and decode: the new tokens' keys and values are written to their
slots first, then every sequence's queries attend over its whole context gathered from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward sit in the batch and in the KV cache.

    The T new tokens of the forward are flat and ordered by sequence; sequence b owns tokens
    [query_start[b], query_start[b + 1]) and, after this forward, context_lens[b] tokens of KV.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (padding repeats a valid id)
    attn_mask: torch.Tensor  # [B, 1, max_query_len, max_context_len] True where a query sees a key
    query_index: torch.Tensor | None  # [B, max_query_len] flat token of each padded query; None in decode
    output_index: torch.Tensor | None  # [T] padded position of each flat token; None in decode
    max_context_len: int


@dataclass(slots=True)
class LayerCache:
    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] -> attention output [T, heads * d]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    key_slots = cache.key.view(-1, num_kv_heads, head_dim)
    value_slots = cache.value.view(-1, num_kv_heads, head_dim)
    key_slots.index_copy_(0, meta.slot_mapping, k)
    value_slots.index_copy_(0, meta.slot_mapping, v)

    batch = meta.block_tables.shape[0]
    # context: [B, kv_heads, max_context_len, d]
    keys = _gather_context(cache.key, meta)
    values = _gather_context(cache.value, meta)
    if meta.query_index is None:
        queries = q.view(batch, 1, num_heads, head_dim)
    else:
        queries = q[meta.query_index]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values,
                                         attn_mask=meta.attn_mask, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    # out: [B, max_query_len, heads * d]
    out = out.transpose(1, 2).reshape(batch, -1, num_heads * head_dim)
    if meta.output_index is None:
        return out.view(num_tokens, num_heads * head_dim)
    return out.reshape(-1, num_heads * head_dim)[meta.output_index]


def _gather_context(blocks: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    batch, max_blocks = meta.block_tables.shape
    _, block_size, num_kv_heads, head_dim = blocks.shape
    gathered = blocks[meta.block_tables].view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    return gathered[:, : meta.max_context_len].transpose(1, 2)
