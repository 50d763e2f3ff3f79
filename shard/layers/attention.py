"""Paged attention: keys and values in fixed-size blocks, each sequence's found by its block table.

Decode attends for the whole batch at once, prefill sequence by sequence (over its own keys, or its
context in the cache when it continues cached tokens). Every path takes a sliding window (a query
sees its last `window` positions, itself included) and a soft cap on the scores (Gemma 2's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from shard.kernels import decode_backend, layer_ops
from shard.kernels import paged_attention as paged_kernel
from shard.layers import kv_int8, prefill_in_place
from shard.layers.attention_state import (AttentionMetadata, DecodeGroup, LayerCache,
                                          gather_index)
from shard.layers.precision import attention_dtype
from shard.layers.rotary import RotaryAngles, apply_rotary

# A soft-capped prefill runs by hand (no fused kernel takes the cap), scoring as many queries at a
# time as keep its float32 scores under this many (64 MiB): a long prompt's [heads, n, n] would
# not fit.
HAND_SCORES = 1 << 24


def rotate_and_store(qkv: torch.Tensor, angles: RotaryAngles, num_heads: int, num_kv_heads: int,
                     head_dim: int, cache: LayerCache, meta: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary queries and keys of a fused qkv projection, with k and v written to their cache slots.

    qkv [T, (heads + 2 kv_heads) * d], a fused projection's output -> q [T, heads, d] and k
    [T, kv_heads, d] rotated, v [T, kv_heads, d]; k and v written to their cache slots."""
    qk_size = (num_heads + num_kv_heads) * head_dim
    v = qkv[:, qk_size:].view(-1, num_kv_heads, head_dim)
    qk = layer_ops.rotary_store(qkv, angles.cos, angles.sin, num_heads, num_kv_heads, head_dim,
                            cache.key, cache.value, meta.slot_blocks, meta.slot_offsets,
                            key_scale=cache.key_scale, value_scale=cache.value_scale)
    if qk is None:
        # queries and keys sit side by side: one rotation covers both
        qk = apply_rotary(qkv[:, :qk_size].view(-1, num_heads + num_kv_heads, head_dim), angles)
        store_kv(qk[:, num_heads:], v, cache, meta)
    return qk[:, :num_heads], qk[:, num_heads:], v


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
    """The cache write of the new tokens' keys and values [T, kv_heads, d] to their slots.

    An int8 cache's are quantized, with their scales."""
    if cache.is_int8:
        kv_int8.store_rows(cache.key, cache.key_scale, k, meta.slot_blocks, meta.slot_offsets)
        kv_int8.store_rows(cache.value, cache.value_scale, v, meta.slot_blocks, meta.slot_offsets)
        return
    # float32 activations over a bf16 cache on CPUs without bf16 arithmetic
    cache.key[meta.slot_blocks, :, meta.slot_offsets] = k.to(cache.key.dtype)
    cache.value[meta.slot_blocks, :, meta.slot_offsets] = v.to(cache.value.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                    meta: AttentionMetadata, scale: float, *, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention of new tokens over the paged cache: q [T, heads, d] -> output [T, heads * d].

    k/v [T, kv_heads, d] are already in the cache (rotate_and_store).

    window: the query at position p sees the keys at p - window + 1 .. p only (transformers'
    sliding_window); softcap: each scaled score s becomes softcap * tanh(s / softcap) before the
    mask and softmax (Gemma 2's attn_logit_softcapping). None: no window, no cap."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} tokens would attend to nothing")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"an attention soft cap must be positive, not {softcap}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    if meta.prefill is None:
        return _decode_attention(q, cache, meta, scale, window, softcap)
    split = meta.num_decode_rows
    if not split:
        return _prefill_attention(q, k, v, cache, meta, scale, gqa, window, softcap)
    return torch.cat([_decode_attention(q[:split], cache, meta, scale, window, softcap),
                      _prefill_attention(q[split:], k[split:], v[split:], cache, meta, scale, gqa,
                                         window, softcap)])


def _decode_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
                      window: int | None, softcap: float | None) -> torch.Tensor:
    if meta.decode_context_lens is not None:
        args = (q, cache.key, cache.value, meta.decode_tables, meta.decode_context_lens, scale)
        if torch.compiler.is_compiling():  # the operator takes 0 for none (and no int8 cache)
            return paged_kernel.paged_decode_attention_op(*args, window or 0, softcap or 0.0)
        # C on the CPU, Triton on CUDA (shard.kernels.decode_backend)
        return decode_backend.paged_decode_attention(*args, window=window, softcap=softcap,
                                                     key_scales=cache.key_scale,
                                                     value_scales=cache.value_scale)
    groups = meta.decode_groups
    if len(groups) == 1 and groups[0].rows is None:
        return _attend_group(q, cache, groups[0], scale, window, softcap)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in groups:
        out.index_copy_(0, group.rows, _attend_group(q.index_select(0, group.rows), cache, group,
                                                     scale, window, softcap))
    return out


def _attend_group(q: torch.Tensor, cache: LayerCache, group: DecodeGroup, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence: two batched matmuls beat a flash kernel at this shape on CPU."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[1]
    keys, values = cache.gather(group.gather_index)  # [G, kv, L, d]
    # the heads sharing a key/value head are adjacent
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    visible = group.mask
    if window is not None and window < visible.shape[1]:
        # a row's context is a prefix of its padded positions: position t lies outside the
        # window exactly where t + window is still context, so the mask shifted left by the
        # window hides it (no lengths read back, and the shapes a CUDA graph fixed stay)
        visible = visible & ~F.pad(visible[:, window:], (0, window))
    out = _grouped_attention(queries, keys, values, visible.view(batch, 1, 1, -1), scale, softcap)
    return out.reshape(batch, num_heads * head_dim).to(q.dtype)


def _grouped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       visible: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention of each key/value head's query rows over its keys, grouped by head.

    queries [B, kv_heads, rows, d] (the rows of a key/value head: the query heads sharing it,
    and their tokens), keys and values [B, kv_heads, L, d], `visible` broadcasting to the scores
    [B, kv_heads, rows, L] -> [B, kv_heads, rows, d] in the dtype of the matmuls."""
    # one dtype for both matmuls (no-op casts when it is theirs already): float32 for a bf16 cache
    # on CPUs that emulate bf16 matmuls (far slower), or for float32 queries over a bf16 cache
    wide = attention_dtype(queries.dtype, keys.dtype, keys.device)
    keys, values, queries = keys.to(wide), values.to(wide), queries.to(wide)
    if wide == torch.float16:  # scaled first: unscaled products can pass float16's 65504
        queries = queries * scale
        scale = 1.0
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                       meta: AttentionMetadata, scale: float, gqa: bool, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    layout = meta.prefill
    starts = layout.query_starts
    in_place = prefill_in_place.routed(q, cache, layout, softcap)  # Triton's, on CUDA
    if in_place:
        in_place_out = prefill_in_place.attend(q, cache, meta, in_place, scale, window, softcap)
        if len(in_place) == len(layout.cached_lens):
            return in_place_out
    through_kernel = [False] * len(layout.cached_lens)
    # the kernel reads the keys from the cache: for a fresh prompt, the ones PyTorch uses only when
    # the cache holds them unrounded (activations in the cache's dtype; never an int8 cache's)
    if layout.row_tables is not None and q.dtype == cache.key.dtype:
        through_kernel = layout.kernel_sequences
        if all(through_kernel):
            return paged_kernel.paged_decode_attention(q, cache.key, cache.value,
                                                       layout.row_tables, layout.row_context_lens,
                                                       scale, window=window, softcap=softcap)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kernel_out = None
    if any(through_kernel):
        rows = torch.cat([torch.arange(starts[b], starts[b + 1], device=q.device)
                          for b, chosen in enumerate(through_kernel) if chosen])
        kernel_out = paged_kernel.paged_decode_attention(
            q.index_select(0, rows), cache.key, cache.value,
            layout.row_tables.index_select(0, rows), layout.row_context_lens.index_select(0, rows),
            scale, window=window, softcap=softcap)
    outputs, kernel_cursor = [], 0
    for b, cached in enumerate(layout.cached_lens):
        start, end = starts[b], starts[b + 1]
        if b in in_place:
            outputs.append(in_place_out[start:end])
            continue
        if through_kernel[b]:  # its rows, in order, from the kernel's output
            outputs.append(kernel_out[kernel_cursor:kernel_cursor + end - start])
            kernel_cursor += end - start
            continue
        spans = layout.image_spans[b] if layout.image_spans is not None else ()
        if window is not None or softcap is not None or spans:
            outputs.append(_windowed_prefill(q[start:end], k[start:end], v[start:end], cache,
                                             meta.block_tables[b:b + 1], cached, scale, window,
                                             softcap, spans, layout.image_masks))
            continue
        queries = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if cached == 0:  # a fresh prompt attends over its own keys, not the cache's rounded copy
            keys = k[start:end].transpose(0, 1).unsqueeze(0)
            values = v[start:end].transpose(0, 1).unsqueeze(0)
            mask = None
        else:
            context = cached + end - start
            index = gather_index(meta.block_tables[b:b + 1], context, cache.key.shape)
            keys, values = cache.gather(index)
            keys, values = keys[:, :, :context], values[:, :, :context]
            # query i sits at position cached + i and sees keys 0..cached + i: the causal mask
            # aligned to the lower right, which CUDA's flash and memory-efficient kernels take
            # without a mask in memory (a boolean one sends SDPA to its math kernel there)
            mask = causal_lower_right(end - start, context)
        out = _sdpa(queries, keys, values, mask, scale, gqa)
        outputs.append(out.squeeze(0).transpose(0, 1).reshape(end - start, num_heads * head_dim))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _windowed_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      block_table: torch.Tensor, cached: int, scale: float, window: int | None,
                      softcap: float | None,
                      spans: list[tuple[int, int]] | tuple = (),
                      masks: dict | None = None) -> torch.Tensor:
    """One sequence's prefill attention under a sliding window and a soft cap, computed by hand.

    The new tokens q [n, heads, d] (k, v [n, kv_heads, d]) at positions cached .. cached + n - 1,
    each seeing the keys of its window -> [n, heads * d]. A window alone is a mask SDPA takes; a
    soft cap changes the scores inside it, so that attention runs here by hand, a slice of queries
    at a time (its float32 scores are [heads, rows, keys]). `spans`: [start, end) positions whose
    tokens also see each other's later keys (an image's, as transformers' Gemma 3 masks them: the
    window still applies); each lies within the new tokens. `masks` keeps the masks built (a
    forward's layers share them)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    context = cached + n
    # the first key any of these queries sees: the blocks before it are not gathered
    first = 0 if window is None else max(0, cached - window + 1)
    if cached == 0:  # a fresh prompt attends over its own keys, not the cache's rounded copy
        offset = 0
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    else:
        block_size = cache.key.shape[2]
        offset = first // block_size * block_size
        index = gather_index(block_table, context, cache.key.shape)[:, :, offset // block_size:]
        keys, values = cache.gather(index)
        keys = keys[:, :, :context - offset]  # [1, kv, keys, d]
        values = values[:, :, :context - offset]
    memo_key = (cached, n, window, tuple(spans))
    visible = masks.get(memo_key) if spans and masks is not None else None
    if visible is None:
        key_positions = torch.arange(offset, context, device=q.device)
        query_positions = torch.arange(cached, context, device=q.device).unsqueeze(1)
        visible = key_positions <= query_positions  # [n, keys]
        for lo, hi in spans:
            visible |= ((query_positions >= lo) & (query_positions < hi)
                        & (key_positions >= lo) & (key_positions < hi))
        if window is not None:
            visible &= key_positions > query_positions - window
        if spans and masks is not None:
            masks[memo_key] = visible
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    if softcap is None:
        out = _sdpa(queries, keys, values, visible, scale, num_heads != num_kv_heads)
        return out.squeeze(0).transpose(0, 1).reshape(n, num_heads * head_dim)
    group = num_heads // num_kv_heads
    # the heads sharing a key/value head are adjacent: [kv, group, n, d]
    queries = queries.view(num_kv_heads, group, n, head_dim)
    rows = max(1, HAND_SCORES // (num_heads * keys.shape[2]))
    outputs = []
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        # the keys these queries see: from the earliest one's window to the last query
        key_lo = 0 if window is None else max(0, cached + lo - window + 1 - offset)
        key_hi = context - offset if spans else cached + hi - offset
        part = _grouped_attention(
            queries[:, :, lo:hi].reshape(1, num_kv_heads, group * (hi - lo), head_dim),
            keys[:, :, key_lo:key_hi], values[:, :, key_lo:key_hi],
            visible[lo:hi, key_lo:key_hi].repeat(group, 1), scale, softcap)
        # [1, kv, group * rows, d] -> [rows, heads * d]
        outputs.append(part.view(num_heads, hi - lo, head_dim).transpose(0, 1)
                       .reshape(hi - lo, num_heads * head_dim))
    return (torch.cat(outputs) if len(outputs) > 1 else outputs[0]).to(q.dtype)


def _sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          mask: CausalBias | torch.Tensor | None, scale: float, gqa: bool) -> torch.Tensor:
    """Causal SDPA of queries over keys that may be in another dtype; out in the query's dtype.

    `mask`: a causal bias, or a boolean [queries, keys] one of the keys each query sees; a square
    causal one when None. The arithmetic is in attention_dtype of the query and keys, which may
    differ (cached keys are in the cache's dtype)."""
    wide = attention_dtype(queries.dtype, keys.dtype, queries.device)
    if mask is not None and gqa and queries.device.type == "cuda":
        keys, values = expand_kv_heads(keys, values, queries.shape[1])
        gqa = False
    out = F.scaled_dot_product_attention(queries.to(wide), keys.to(wide), values.to(wide),
                                         attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=gqa)
    return out.to(queries.dtype)


def expand_kv_heads(keys: torch.Tensor, values: torch.Tensor,
                    num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated per query head: [B, kv_heads, L, d] -> [B, heads, L, d].

    Each key/value head lands beside the query heads that share it. A lower-right causal mask
    reaches CUDA's kernels without SDPA's GQA handling, so their heads must match; the copy is the
    context's keys, not a score matrix."""
    repeats = num_heads // keys.shape[1]
    return keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
