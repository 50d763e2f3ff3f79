"""A decoder layer's element-wise steps on CUDA in Triton: add+norm, rotary+KV write.

The residual add with its RMS norm, and the rotary with the KV cache write, as
shard/kernels/layer_ops.c has them on the CPU: each one launch where PyTorch eager launches several
(the add and the norm's five ops; the rotation's three and two cache writes, or an int8 cache's
quantization and four writes), rounding where those ops round. shard.kernels.layer_ops selects
them (triton_ops); importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the widest row one program normalizes (Llama 3 405B's hidden size); wider ones keep PyTorch's ops
MAX_NORM_DIM = 16384
QMAX = tl.constexpr(127.0)  # shard.layers.kv_int8's; a plain global does not compile for a GPU


@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, summed_ptr, weight_ptr, out_ptr, eps,
                  DIM: tl.constexpr, PAD_DIM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  SCALE_WIDE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, PAD_DIM)
    mask = i < DIM
    x = tl.load(x_ptr + row * DIM + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum rounded to the activations' dtype, as PyTorch's add rounds it
        summed = (x.to(tl.float32) + tl.load(residual_ptr + row * DIM + i, mask=mask,
                                             other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * DIM + i, summed, mask=mask)
    else:
        summed = x
    wide = summed.to(tl.float32)
    inverse = tl.math.rsqrt(tl.sum(wide * wide, 0) / DIM + eps)
    if SCALE_WIDE:  # Gemma's: scaled in float32, rounded once
        normed = wide * inverse
    else:  # Llama's: rounded to the activations' dtype, then scaled
        normed = (wide * inverse).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * DIM + i, (weight * normed).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *,
             scale_wide: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """layer_ops.rms_norm's (normed, summed) in one launch; None where its PyTorch form runs.

    Contiguous rows of one dtype, no wider than MAX_NORM_DIM; the weight in that dtype too, or
    in float32 with `scale_wide` (Gemma's norm)."""
    dim = x.shape[-1]
    tensors = (x, weight) if residual is None else (x, weight, residual)
    weight_dtype = torch.float32 if scale_wide else x.dtype
    if (dim > MAX_NORM_DIM or weight.dtype != weight_dtype
            or any(t.dtype != x.dtype for t in tensors if t is not weight)
            or any(not t.is_contiguous() for t in tensors)):
        return None
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    rows = x.numel() // dim
    if rows:
        _add_rms_norm[(rows,)](x, x if residual is None else residual, summed, weight, out,
                               float(eps), DIM=dim, PAD_DIM=triton.next_power_of_2(dim),
                               HAS_RESIDUAL=residual is not None, SCALE_WIDE=scale_wide,
                               num_warps=8 if dim >= 2048 else 4)
    return out, summed


@triton.jit
def _round_half_even(y):
    """torch.round's rounding of float32 values: halves to the even neighbour."""
    low = tl.floor(y)
    part = y - low  # exact: y and its floor are within 1 of each other
    is_even = low - 2.0 * tl.floor(low * 0.5) == 0.0
    up = (part > 0.5) | ((part == 0.5) & ~is_even)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _store_row(cache_ptr, scale_ptr, row, mask, INT8: tl.constexpr):
    """One key or value row into the cache: as it is, or as int8 with its scale (kv_int8's)."""
    if INT8:
        wide = row.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.where(mask, tl.abs(wide), 0.0), 0), QMAX)
        divisor = tl.where(scale > 0, scale, 1.0)
        quantized = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(wide, divisor)),
                                          -QMAX), QMAX)
        tl.store(cache_ptr, quantized.to(tl.int8), mask=mask)
        tl.store(scale_ptr, scale)
    else:
        tl.store(cache_ptr, row.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store(qkv_ptr, cos_ptr, sin_ptr, qk_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                  v_scale_ptr, blocks_ptr, offsets_ptr,
                  stride_qkv_row, stride_angle_row,
                  stride_cache_block, stride_cache_head, stride_cache_token,
                  stride_scale_block, stride_scale_head,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAD_DIM: tl.constexpr, INT8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # a query head, then the key heads
    d = tl.arange(0, PAD_DIM)
    mask = d < HEAD_DIM
    x_at = qkv_ptr + token * stride_qkv_row + head * HEAD_DIM
    x = tl.load(x_at + d, mask=mask, other=0.0)
    # apply_rotary's x * cos + roll(x, half) * sin (the sign in sin's table), rounded where it is
    rolled = tl.load(x_at + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_angle_row + d, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_angle_row + d, mask=mask, other=0.0).to(tl.float32)
    scaled = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    rotated = (scaled + rolled.to(tl.float32) * sin).to(x.dtype)
    tl.store(qk_ptr + (token * (NUM_HEADS + NUM_KV_HEADS) + head) * HEAD_DIM + d, rotated,
             mask=mask)
    if head >= NUM_HEADS:  # a key head: its key and value into their slot
        kv_head = head - NUM_HEADS
        block = tl.load(blocks_ptr + token).to(tl.int64)
        offset = tl.load(offsets_ptr + token).to(tl.int64)
        slot = block * stride_cache_block + kv_head * stride_cache_head + offset * stride_cache_token
        scale_at = block * stride_scale_block + kv_head * stride_scale_head + offset
        value = tl.load(x_at + NUM_KV_HEADS * HEAD_DIM + d, mask=mask, other=0.0)
        _store_row(k_cache_ptr + slot + d, k_scale_ptr + scale_at, rotated, mask, INT8)
        _store_row(v_cache_ptr + slot + d, v_scale_ptr + scale_at, value, mask, INT8)


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                 *, key_scale: torch.Tensor | None = None,
                 value_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """layer_ops.rotary_store's contract in one launch; None where its PyTorch form runs.

    qkv [T, (heads + 2 kv_heads) * d] -> rotated q and k [T, heads + kv_heads, d]; k and v
    written to their slots (an int8 cache's quantized with their scales, as kv_int8 does)."""
    tokens = qkv.shape[0]
    is_int8 = key_cache.dtype == torch.int8
    if (qkv.stride(1) != 1 or head_dim % 2 or cos.shape[-1] != head_dim or cos.dtype != qkv.dtype
            or cos.stride(-1) != 1 or sin.stride() != cos.stride()
            or value_cache.stride() != key_cache.stride() or key_cache.stride(3) != 1
            or value_cache.dtype != key_cache.dtype or key_cache.shape[1] != num_kv_heads
            or (is_int8 and (key_scale is None or value_scale is None
                             or value_scale.stride() != key_scale.stride()
                             or key_scale.stride(2) != 1))):
        return None
    qk = qkv.new_empty(tokens, num_heads + num_kv_heads, head_dim)
    if not tokens:
        return qk
    scales = key_scale if is_int8 else key_cache  # unread without an int8 cache
    _rotary_store[(tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, qk, key_cache, value_cache, scales,
        value_scale if is_int8 else value_cache, slot_blocks, slot_offsets,
        qkv.stride(0), cos.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        scales.stride(0), scales.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        PAD_DIM=triton.next_power_of_2(head_dim), INT8=is_int8)
    return qk
