"""Paged prefill attention in Triton: new tokens over their cached prefix, read where it lies.

A continued prompt (a prefix-cache hit, a chunk of a long prompt) used to gather its whole cached
context into a copy before SDPA; here each program takes a tile of one sequence's new tokens for
one key/value head (the query heads sharing it scored together, grouped queries) and walks the
sequence's blocks through its table with an online softmax, causal from each token's position,
under a sliding window and a soft cap when given. The new tokens' keys and values are in the cache
already (rotate_and_store wrote them), so the prefix and the new tokens are read alike.

Importing this module imports Triton (see shard.kernels.decode_backend).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.triton_attention import block_scores, block_values, check_cache, padded

# rows (query tokens x the heads sharing a key/value head) a program scores at once
TILE_ROWS = 64


@triton.jit
def _paged_prefill(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, tile_seq_ptr,
                   tile_first_ptr, starts_ptr, cached_ptr, out_ptr,
                   stride_q_row, stride_q_head, stride_table_row, stride_out_row,
                   stride_cache_block, stride_cache_head, stride_cache_token,
                   stride_scale_block, stride_scale_head,
                   scale, softcap, window,
                   GROUP: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PAD_ROWS: tl.constexpr, PAD_DIM: tl.constexpr,
                   PAD_BLOCK: tl.constexpr, INT8: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first_token = tl.load(tile_first_ptr + tile)  # the tile's first new token, in its sequence
    q_start = tl.load(starts_ptr + seq)
    num_new = tl.load(starts_ptr + seq + 1) - q_start
    cached = tl.load(cached_ptr + seq)
    m = tl.arange(0, PAD_ROWS)
    d = tl.arange(0, PAD_DIM)
    n = tl.arange(0, PAD_BLOCK)
    # row m: token first_token + m // GROUP, query head kv_head * GROUP + m % GROUP
    token = first_token + m // GROUP
    heads = kv_head * GROUP + m % GROUP
    is_row = (m < TOKENS * GROUP) & (token < num_new)
    q_mask = is_row[:, None] & (d[None, :] < HEAD_DIM)
    flat = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + flat[:, None] * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=q_mask, other=0.0)
    position = cached + token  # each query's position; it sees keys up to it
    last = tl.minimum(cached + first_token + TOKENS, cached + num_new) - 1
    lo = 0
    if HAS_WINDOW:  # the tile's first query sees from its window's first position on
        lo = tl.maximum(cached + first_token - window + 1, 0)
    token_mask = n < BLOCK_SIZE
    kv_mask = token_mask[:, None] & (d[None, :] < HEAD_DIM)
    best = tl.full([PAD_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([PAD_ROWS], tl.float32)
    acc = tl.zeros([PAD_ROWS, PAD_DIM], tl.float32)
    for j in range(lo // BLOCK_SIZE, last // BLOCK_SIZE + 1):
        block = tl.load(tables_ptr + seq * stride_table_row + j).to(tl.int64)
        offsets = (block * stride_cache_block + kv_head * stride_cache_head
                   + n[:, None] * stride_cache_token + d[None, :])
        scale_at = block * stride_scale_block + kv_head * stride_scale_head + n
        scores = block_scores(q, k_ptr, k_scale_ptr, offsets, scale_at, kv_mask, token_mask,
                              scale, softcap, INT8, HAS_SOFTCAP)  # [rows, block]
        key_position = j * BLOCK_SIZE + n
        visible = token_mask[None, :] & (key_position[None, :] <= position[:, None])
        if HAS_WINDOW:
            visible &= key_position[None, :] > position[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        # a row may see nothing yet (a block past it, or before its window): it keeps 0s
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)
        rescale = tl.exp(best - safe)
        probs = tl.exp(scores - safe[:, None])
        total = total * rescale + tl.sum(probs, 1)
        acc = block_values(acc, probs, rescale, q, v_ptr, v_scale_ptr, offsets, scale_at,
                           kv_mask, token_mask, INT8)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + flat[:, None] * stride_out_row + heads[:, None] * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: list[int],
                            cached_lens: list[int], sequences: list[int], scale: float, *,
                            window: int | None = None, softcap: float | None = None,
                            key_scales: torch.Tensor | None = None,
                            value_scales: torch.Tensor | None = None,
                            memo: dict | None = None) -> torch.Tensor:
    """Prefill attention read from the paged cache: q [T, heads, d] -> [T, heads * d].

    Sequence b's new tokens are q's rows query_starts[b] .. query_starts[b + 1], at positions
    cached_lens[b] on, their keys and values already in the cache through block_tables[b]; each
    sees the keys up to its own position (its last `window` only when given), each scaled score
    soft-capped when given. Only the rows of `sequences` (indices of b) are written; the others
    are left as torch.empty left them. Caches, scales and arithmetic as the decode kernel's.
    `memo` keeps the tile lists uploaded to the device (a forward's layers share them)."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    is_int8 = check_cache(num_heads, key_cache, value_cache, key_scales, value_scales)
    if q.stride(2) != 1:
        q = q.contiguous()
    queries = q if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else q.float()
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    group = num_heads // num_kv_heads
    tokens = max(1, TILE_ROWS // group)  # new tokens a program takes
    key = (tokens, tuple(sequences))
    index, lists = (memo or {}).get(key) or _tiles(query_starts, cached_lens, sequences, tokens,
                                                   q.device)
    if memo is not None:
        memo[key] = (index, lists)
    if not index.shape[1]:
        return out
    scales = key_scales if is_int8 else key_cache  # unread without an int8 cache
    _paged_prefill[(index.shape[1], num_kv_heads)](
        queries, key_cache, value_cache, scales, value_scales if is_int8 else value_cache,
        block_tables, index[0], index[1], lists[0], lists[1], out,
        queries.stride(0), queries.stride(1), block_tables.stride(0), out.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        scales.stride(0), scales.stride(1),
        float(scale), float(softcap or 0.0), int(window or 0),
        GROUP=group, TOKENS=tokens, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PAD_ROWS=padded(tokens * group), PAD_DIM=padded(head_dim), PAD_BLOCK=padded(block_size),
        INT8=is_int8, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None)
    return out


def _tiles(query_starts: list[int], cached_lens: list[int], sequences: list[int], tokens: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, tiles]: each tile's sequence and first new token; [2, B + 1]: starts and cached lengths.

    Host lists in one upload each; nothing is read back."""
    tile_seq, tile_first = [], []
    for b in sequences:
        for first in range(0, query_starts[b + 1] - query_starts[b], tokens):
            tile_seq.append(b)
            tile_first.append(first)
    index = torch.tensor([tile_seq, tile_first], dtype=torch.int32).to(device, non_blocking=True)
    lists = torch.tensor([query_starts, cached_lens + [0]], dtype=torch.int32).to(
        device, non_blocking=True)
    return index, lists
