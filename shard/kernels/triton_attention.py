"""Paged decode attention in Triton: each sequence's keys and values read where they lie.

The CUDA counterpart of the C kernel (shard/kernels/paged_attention.c): no context is gathered
into a copy first, so a step reads each cached key and value once. One program per sequence and
key/value head scores all the query heads sharing that head at once (grouped queries), walking
the sequence's blocks through its table with an online softmax. With few such programs (one stream
or a few over long contexts would leave most of a GPU idle) each sequence's blocks are split among
several programs whose partial softmaxes a second kernel combines (flash-decoding); the number of
splits depends on shapes only (triton_shapes.decode_splits). The grid and every tensor shape are
fixed by the inputs' shapes and the context lengths are read on the device, so a CUDA graph
records a call as it is.

Importing this module imports Triton: shard.kernels.decode_backend imports it only once Triton is
known to import. Under TRITON_INTERPRET=1 it runs on CPU tensors (how the tests check it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard.kernels.triton_shapes import TRITON_CACHE_DTYPES, decode_splits, programs_wanted

# tl.dot's smallest operand sides; a group of query heads, a block and a head are padded up to it
MIN_DOT = 16


@triton.jit
def block_scores(q, k_ptr, k_scale_ptr, offsets, scale_at, kv_mask, token_mask, scale, softcap,
                 INT8: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """q's rows against one cache block's keys, read in place: scaled (and capped) float32 scores.

    The products take q's dtype: an int8 cache's values (integers up to 127) are exact in any of
    them, a bf16 cache's exact in float32; an int8 block's scales apply to the sums."""
    keys = tl.load(k_ptr + offsets, mask=kv_mask, other=0).to(q.dtype)
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [rows, block] float32
    if INT8:
        scores *= tl.load(k_scale_ptr + scale_at, mask=token_mask, other=0.0)[None, :]
    scores *= scale
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through the sigmoid Triton has
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores


@triton.jit
def block_values(acc, probs, rescale, q, v_ptr, v_scale_ptr, offsets, scale_at, kv_mask,
                 token_mask, INT8: tl.constexpr):
    """The running sum rescaled, plus one cache block's values weighted by `probs` (q's dtype)."""
    values = tl.load(v_ptr + offsets, mask=kv_mask, other=0).to(q.dtype)
    if INT8:
        probs *= tl.load(v_scale_ptr + scale_at, mask=token_mask, other=0.0)[None, :]
    return acc * rescale[:, None] + tl.dot(probs.to(q.dtype), values, input_precision="ieee")


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr, out_ptr,
                  part_ptr, best_ptr, total_ptr,
                  stride_q_row, stride_q_head, stride_table_row, stride_out_row,
                  stride_cache_block, stride_cache_head, stride_cache_token,
                  stride_scale_block, stride_scale_head,
                  scale, softcap, window,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  PAD_GROUP: tl.constexpr, PAD_DIM: tl.constexpr, PAD_BLOCK: tl.constexpr,
                  INT8: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  IS_SPLIT: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # a runtime count, not a constant: a context growing past each share adds no compilation
    num_splits = tl.num_programs(2)
    g = tl.arange(0, PAD_GROUP)
    d = tl.arange(0, PAD_DIM)
    n = tl.arange(0, PAD_BLOCK)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=q_mask, other=0.0)
    length = tl.load(lens_ptr + row)
    start = 0
    if HAS_WINDOW:  # the query sees its last `window` positions, itself included
        start = tl.maximum(length - window, 0)
    token_mask = n < BLOCK_SIZE
    kv_mask = token_mask[:, None] & (d[None, :] < HEAD_DIM)
    best = tl.full([PAD_GROUP], float("-inf"), tl.float32)
    total = tl.zeros([PAD_GROUP], tl.float32)
    acc = tl.zeros([PAD_GROUP, PAD_DIM], tl.float32)
    first = start // BLOCK_SIZE
    last = tl.cdiv(length, BLOCK_SIZE)
    if IS_SPLIT:  # this program's share of the row's visible blocks (the last ones may be empty)
        share = tl.cdiv(last - first, num_splits)
        first = tl.minimum(first + split * share, last)
        last = tl.minimum(first + share, last)
    for j in range(first, last):
        block = tl.load(tables_ptr + row * stride_table_row + j).to(tl.int64)
        offsets = (block * stride_cache_block + kv_head * stride_cache_head
                   + n[:, None] * stride_cache_token + d[None, :])
        scale_at = block * stride_scale_block + kv_head * stride_scale_head + n
        scores = block_scores(q, k_ptr, k_scale_ptr, offsets, scale_at, kv_mask, token_mask,
                              scale, softcap, INT8, HAS_SOFTCAP)  # [group, block]
        position = j * BLOCK_SIZE + n
        visible = token_mask & (position < length) & (position >= start)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        # every block from the window's first on holds a visible position: new_best is finite
        rescale = tl.exp(best - new_best)
        probs = tl.exp(scores - new_best[:, None])
        total = total * rescale + tl.sum(probs, 1)
        acc = block_values(acc, probs, rescale, q, v_ptr, v_scale_ptr, offsets, scale_at,
                           kv_mask, token_mask, INT8)
        best = new_best
    if IS_SPLIT:  # the partial softmax, [B, heads, splits] and [B, heads, splits, d]
        at = (row * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(best_ptr + at, best, mask=g < GROUP)
        tl.store(total_ptr + at, total, mask=g < GROUP)
        tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    else:
        tl.store(out_ptr + row * stride_out_row + heads[:, None] * HEAD_DIM + d[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_splits(part_ptr, best_ptr, total_ptr, out_ptr, stride_out_row, num_splits,
                    HEAD_DIM: tl.constexpr, PAD_SPLITS: tl.constexpr,
                    PAD_DIM: tl.constexpr):
    """One row and query head: its num_splits partial softmaxes rescaled to their common maximum."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, PAD_SPLITS)
    d = tl.arange(0, PAD_DIM)
    at = (row * tl.num_programs(1) + head) * num_splits + s
    best = tl.load(best_ptr + at, mask=s < num_splits, other=float("-inf"))
    total = tl.load(total_ptr + at, mask=s < num_splits, other=0.0)
    part = tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :],
                   mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM), other=0.0)
    # the first split always holds the row's first visible block: the maximum is finite, and an
    # empty split (best -inf) weighs 0
    weight = tl.exp(best - tl.max(best, 0))
    out = tl.sum(part * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(out_ptr + row * stride_out_row + head * HEAD_DIM + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, window: int | None = None,
                           softcap: float | None = None, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, heads, d] -> [B, heads * d] in q's dtype.

    The same contract as shard.kernels.paged_attention.paged_decode_attention: sequence b attends
    over context_lens[b] tokens through block_tables [B, blocks], its last `window` only when
    given, each scaled score soft-capped when given; an int8 cache comes with its float32 scales
    [num_blocks, kv_heads, block_size]. Scores and the softmax are float32; the matmuls take the
    query's dtype (bf16 queries: bf16 products, float32 sums; float32 queries over a bf16 cache
    widen it exactly, as the C kernel does). `splits`: the programs sharing each row's blocks;
    chosen from the shapes when None (triton_shapes.decode_splits)."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    is_int8 = check_cache(num_heads, key_cache, value_cache, key_scales, value_scales)
    if q.stride(2) != 1:
        q = q.contiguous()
    queries = q if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else q.float()
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    group = num_heads // num_kv_heads
    scales = key_scales if is_int8 else key_cache  # unread without an int8 cache
    if splits is None:
        splits = decode_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                               programs_wanted(q.device))
    if splits > 1:
        best = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
        part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)
    else:
        best = total = part = out  # unwritten
    _paged_decode[(batch, num_kv_heads, splits)](
        queries, key_cache, value_cache, scales, value_scales if is_int8 else value_cache,
        block_tables, context_lens, out, part, best, total,
        queries.stride(0), queries.stride(1), block_tables.stride(0), out.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        scales.stride(0), scales.stride(1),
        float(scale), float(softcap or 0.0), int(window or 0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PAD_GROUP=padded(group), PAD_DIM=padded(head_dim), PAD_BLOCK=padded(block_size),
        INT8=is_int8, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        IS_SPLIT=splits > 1)
    if splits > 1:
        _combine_splits[(batch, num_heads)](part, best, total, out, out.stride(0), splits,
                                            HEAD_DIM=head_dim, PAD_SPLITS=padded(splits, 2),
                                            PAD_DIM=padded(head_dim))
    return out


def check_cache(num_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> bool:
    """Whether the cache is int8, once it is one the kernels read; a ValueError otherwise."""
    if key_cache.dtype not in TRITON_CACHE_DTYPES:
        raise ValueError(f"the Triton kernel reads float16, bfloat16, float32 or int8 caches, not "
                         f"{key_cache.dtype}")
    if (value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape
            or value_cache.stride() != key_cache.stride() or key_cache.stride(3) != 1):
        raise ValueError("the key and value caches must share one dtype, shape and layout, "
                         "their rows contiguous")
    is_int8 = key_cache.dtype == torch.int8
    if is_int8 and (key_scales is None or value_scales is None
                    or key_scales.shape != key_cache.shape[:3]
                    or value_scales.stride() != key_scales.stride()):
        raise ValueError(f"an int8 cache needs float32 scales shaped {tuple(key_cache.shape[:3])}")
    if num_heads % key_cache.shape[1]:
        raise ValueError(f"{num_heads} query heads cannot share {key_cache.shape[1]} key/value "
                         "heads")
    return is_int8


def padded(size: int, least: int = MIN_DOT) -> int:
    """The power of two at least `size` and `least`: a tile side Triton accepts."""
    return max(least, triton.next_power_of_2(size))
