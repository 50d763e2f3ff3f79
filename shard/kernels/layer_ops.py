"""A decoder layer's element-wise steps in C: RMS norm, rotary, KV cache writes, SiLU-and-multiply.

Each is one C call (shard/kernels/layer_ops.c) on the CPU where PyTorch eager dispatches several
ops, rounding where those ops round; on CUDA the residual add with its norm, and the rotary with
the KV cache write, are one Triton launch each (shard/kernels/triton_layer_ops.py).
"""
from __future__ import annotations

import ctypes
import functools
from types import ModuleType

import torch

from shard.config import kernel_enabled
from shard.kernels import decode_backend, native

SOURCE = native.KERNELS / "layer_ops.c"
# no fused multiply-adds the PyTorch ops they stand for do not make: the same roundings; no
# floating-point traps, so that loops with selects (the exponential's range) vectorize on AVX2 too
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-shared",
         "-fPIC"]
ENABLED_ENV = "TGI_PY_FUSED_OPS"
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "a layer's element-wise steps run as PyTorch ops")
    if library is None:
        return None
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, flag]
    library.silu_mul.argtypes = [ptr, ptr, i64, i64, flag]
    library.rotary_store.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, flag, ptr, ptr, ptr,
                                     flag, ptr, ptr, i64, i64]
    library.rotary_store.restype = ctypes.c_int
    library.rotary_store_int8.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, flag, ptr, ptr,
                                          ptr, ptr, ptr, ptr, ptr, i64, i64]
    library.rotary_store_int8.restype = ctypes.c_int
    library.greedy_pick.argtypes = [ptr, i64, i64, ptr, ptr]
    for fn in (library.rms_norm, library.silu_mul, library.greedy_pick):
        fn.restype = None
    return library


@functools.cache
def triton_ops() -> ModuleType | None:
    """shard.kernels.triton_layer_ops, or None (TGI_PY_FUSED_OPS=0, or no Triton)."""
    if not kernel_enabled(ENABLED_ENV):
        return None
    try:
        from shard.kernels import triton_layer_ops
    except ImportError:  # CPU builds of PyTorch come without Triton
        return None
    return triton_layer_ops


def _on_cuda(tensor: torch.Tensor) -> ModuleType | None:
    """triton_ops where `tensor` is on CUDA (and no torch.compile trace is running), else None."""
    if not tensor.is_cuda or torch.compiler.is_compiling() or decode_backend.triton_refused():
        return None
    return triton_ops()


def _fused(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when these tensors can go through it; else None.

    With None the op keeps its PyTorch form: no library (no C compiler, TGI_PY_FUSED_OPS=0), off the
    CPU, dtypes other than float32 and bf16, or while torch.compile traces a step (inductor fuses
    the PyTorch form)."""
    # called a few hundred times a decode step: plain attribute checks, no generator
    if torch.compiler.is_compiling():
        return None
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return None
    for tensor in tensors:
        if not tensor.is_cpu or tensor.dtype != dtype or not tensor.is_contiguous():
            return None
    return load_library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *,
             scale_wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * h / rms(h), h) for h = x (+ residual): the normed rows and the residual stream.

    Llama's norm rounds h / rms(h) to x's dtype before scaling it; with `scale_wide` (Gemma's,
    whose weight is float32) the scaling is in float32 too, rounded once. Both are one launch
    on CUDA (Triton) and one C call on the CPU where the dtypes are one."""
    triton_form = _on_cuda(x)
    fused = (triton_form.rms_norm(x, weight, eps, residual, scale_wide=scale_wide)
             if triton_form else None)
    if fused is not None:
        return fused
    # float32 rows with a float32 weight round nothing: the C call computes either norm
    lib = _fused(x, weight) if residual is None else _fused(x, weight, residual)
    if lib is None:
        summed = x if residual is None else x + residual
        dtype = summed.dtype
        wide = summed.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        if scale_wide:
            return (normed * weight).to(dtype), summed
        return weight * normed.to(dtype), summed
    dim = x.shape[-1]
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                 None if residual is None else summed.data_ptr(), weight.data_ptr(),
                 out.data_ptr(), x.numel() // dim, dim, eps, int(x.dtype == torch.bfloat16))
    return out, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2 * width] (gate first)."""
    lib = _fused(gate_up)
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width,
                 int(gate_up.dtype == torch.bfloat16))
    return out


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_blocks: torch.Tensor,
                 slot_offsets: torch.Tensor, *, key_scale: torch.Tensor | None = None,
                 value_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rotated queries and keys [T, num_heads + num_kv_heads, head_dim], keys and values cached.

    qkv is [T, (num_heads + 2 num_kv_heads) * head_dim]; the keys and values are written to their
    cache slots. None where the fused form does not apply (the caller then rotates and stores in
    PyTorch). cos/sin [T, head_dim] are each token's angles (shard.layers.rotary). An int8 cache
    comes with its scales [blocks, kv_heads, block_size] (shard.layers.kv_int8), which the rows'
    get."""
    triton_form = _on_cuda(qkv)
    if triton_form is not None:
        return triton_form.rotary_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim,
                                        key_cache, value_cache, slot_blocks, slot_offsets,
                                        key_scale=key_scale, value_scale=value_scale)
    lib = _fused(qkv, cos, sin)
    is_int8 = key_cache.dtype == torch.int8
    if (lib is None or key_cache.device.type != "cpu"
            or key_cache.dtype not in (*_DTYPES, torch.int8)
            or value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or slot_blocks.dtype != torch.int64 or slot_offsets.dtype != torch.int64
            or not slot_blocks.is_contiguous() or not slot_offsets.is_contiguous()):
        return None
    tokens = qkv.shape[0]
    num_blocks, cache_heads, block_size, cache_dim = key_cache.shape
    if (qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or cache_heads != num_kv_heads
            or cache_dim != head_dim or slot_blocks.shape != (tokens,)
            or slot_offsets.shape != (tokens,) or cos.numel() != tokens * head_dim
            or sin.numel() != tokens * head_dim):
        raise ValueError(f"rotary_store: qkv {tuple(qkv.shape)}, cache {tuple(key_cache.shape)}, "
                         f"{tokens} slots do not fit {num_heads} heads over {num_kv_heads} of "
                         f"{head_dim} dims")
    qk = qkv.new_empty(tokens, num_heads + num_kv_heads, head_dim)
    if is_int8:
        # the C writes go through raw pointers: the scales must be the cache's own layout
        for scales in (key_scale, value_scale):
            if (scales is None or scales.dtype != torch.float32 or not scales.is_contiguous()
                    or scales.shape != key_cache.shape[:3]):
                raise ValueError(f"rotary_store: an int8 cache {tuple(key_cache.shape)} needs "
                                 "float32 scales of its first three dimensions")
        status = lib.rotary_store_int8(
            qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), sin.data_ptr(), tokens, num_heads,
            num_kv_heads, head_dim, int(qkv.dtype == torch.bfloat16), qk.data_ptr(),
            key_cache.data_ptr(), value_cache.data_ptr(), key_scale.data_ptr(),
            value_scale.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(), num_blocks,
            block_size)
    else:
        status = lib.rotary_store(
            qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), sin.data_ptr(), tokens, num_heads,
            num_kv_heads, head_dim, int(qkv.dtype == torch.bfloat16), qk.data_ptr(),
            key_cache.data_ptr(), value_cache.data_ptr(), int(key_cache.dtype == torch.bfloat16),
            slot_blocks.data_ptr(), slot_offsets.data_ptr(), num_blocks, block_size)
    if status != 0:
        raise IndexError("a KV slot lies outside the cache")
    return qk


def greedy_pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax, log_softmax at the argmax) of each row of float32 scores [rows, vocab].

    In two passes over each row and without writing the log-probabilities of the whole vocabulary;
    None where the fused form does not apply (the caller computes log_softmax)."""
    if scores.dtype != torch.float32 or scores.dim() != 2 or _fused(scores) is None:
        return None
    rows, vocab = scores.shape
    ids = torch.empty(rows, dtype=torch.long)
    logprobs = torch.empty(rows, dtype=torch.float32)
    load_library().greedy_pick(scores.data_ptr(), rows, vocab, ids.data_ptr(), logprobs.data_ptr())
    return ids, logprobs
