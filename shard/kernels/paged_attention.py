"""The C decode-attention kernel (shard/kernels/paged_attention.c), built for this CPU on first use.

It reads each key and value once where it lies in the paged cache, where PyTorch first gathers
every context into a contiguous copy.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.kernels import native

SOURCE = native.KERNELS / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# TGI_PY_PAGED_KERNEL=0 keeps decode attention in PyTorch (for comparisons and bisecting)
ENABLED_ENV = "TGI_PY_PAGED_KERNEL"
_cpu_flags = native.cpu_flags


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (disabled, not an x86/ARM Linux build, or no C compiler)."""
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "decode attention stays in PyTorch, which copies every context "
                                  "out of the paged cache each step")
    if library is None:
        return None
    fn = library.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ctypes.c_int, ptr, ctypes.c_int, i64, ptr, i64, ptr, i64, i64, i64,
                   i64, i64, ctypes.c_float, i64, ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = library.paged_decode_attention_int8
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr, i64, i64, i64, i64,
                   i64, ctypes.c_float, i64, ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return library


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention over a KV cache of this device and dtype runs in the kernel.

    An int8 cache runs with its scales."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.int8)
            and load_kernel() is not None)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, window: int | None = None,
                           softcap: float | None = None, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, heads, d] -> [B, heads * d].

    One query token per sequence; sequence b attends over context_lens[b] tokens read through
    block_tables [B, blocks] (both int64): its last `window` ones only, when given (the older ones
    are not read), with each scaled score soft-capped to softcap * tanh(score / softcap), when
    given.

    The arithmetic is float32 on every CPU, whichever of float32 and bf16 the query and the cache
    are: the kernel widens bf16 queries, keys and values in registers (exact, and no slower than
    reading them), so a bf16-capable CPU gains nothing from bf16 products here. Out in q's dtype
    (a bf16 output rounded once, from float32, as `.to()` rounds).

    An int8 cache comes with key_scales and value_scales [num_blocks, kv_heads, block_size]
    float32: each row stands for its int8 values times its scale (shard.layers.kv_int8)."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    # the kernel reads the caches through raw pointers as float32, bf16 or int8 rows of this layout
    # checked, not asserted: the C kernel reads through these tensors' raw pointers
    if key_cache.dtype not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"the paged kernel reads float32, bfloat16 or int8 caches, not "
                         f"{key_cache.dtype}")
    if (value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()):
        raise ValueError("the key and value caches must be contiguous, of one dtype and shape")
    is_int8 = key_cache.dtype == torch.int8
    if is_int8:
        for scales in (key_scales, value_scales):
            if (scales is None or scales.dtype != torch.float32
                    or scales.shape != key_cache.shape[:3] or not scales.is_contiguous()):
                raise ValueError("an int8 cache needs contiguous float32 scales shaped "
                                 f"{tuple(key_cache.shape[:3])}")
    queries = q if q.dtype in (torch.float32, torch.bfloat16) else q.float()
    if queries.stride(2) != 1 or queries.stride(1) != head_dim:
        queries = queries.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, num_heads * head_dim, dtype=queries.dtype)
    kernel = load_kernel()
    rest = (queries.data_ptr(), int(queries.dtype == torch.bfloat16), queries.stride(0),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, num_heads, num_kv_heads,
            head_dim, block_size, scale, window or 0, softcap or 0.0, out.data_ptr(),
            int(out.dtype == torch.bfloat16))
    if is_int8:
        status = kernel.paged_decode_attention_int8(
            key_cache.data_ptr(), value_cache.data_ptr(), key_scales.data_ptr(),
            value_scales.data_ptr(), *rest)
    else:
        status = kernel.paged_decode_attention(
            key_cache.data_ptr(), value_cache.data_ptr(), int(key_cache.dtype == torch.bfloat16),
            *rest)
    if status != 0:
        raise MemoryError("decode attention could not allocate its scratch buffers")
    return out.to(q.dtype)


@torch.library.custom_op("tgi::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float, window: int, softcap: float) -> torch.Tensor:
    """paged_decode_attention as an operator: what a compiled step calls.

    A compiler cannot see into the kernel's raw pointers. window and softcap 0: none."""
    return paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale,
                                  window=window or None, softcap=softcap or None)


@paged_decode_attention_op.register_fake
def _(q, key_cache, value_cache, block_tables, context_lens, scale, window, softcap):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
