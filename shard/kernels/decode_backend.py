"""Which kernel attention reads the paged cache with: C on CPUs, Triton on CUDA, or none.

Both read each sequence's keys and values where they lie. Where neither runs (another device,
Triton missing, a cache dtype neither reads, or either turned off by its variable), PyTorch
gathers each context into a copy and attends over it (shard.layers.attention's decode groups).
"""
from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from shard.config import decode_path_refusal, device_refusal
from shard.kernels import paged_attention
from shard.kernels.triton_shapes import TRITON_CACHE_DTYPES

log = logging.getLogger("tgi.shard.decode_backend")

C = "c"
TRITON = "triton"
# TGI_PY_TRITON_ATTENTION=0 keeps CUDA attention in PyTorch (for comparisons and bisecting)
TRITON_ENV = "TGI_PY_TRITON_ATTENTION"
# why Triton's kernels are not used in this process, once triton_probe found them failing here
_refusals: list[str] = []


def refuse_triton(reason: str) -> None:
    """Turns Triton's kernels off in this process (attention and layer ops alike)."""
    _refusals.append(reason)
    triton_kernel.cache_clear()


def triton_refused() -> str | None:
    """Why Triton's kernels were turned off (refuse_triton), or None."""
    return _refusals[0] if _refusals else None


@functools.cache
def triton_kernel() -> ModuleType | None:
    """shard.kernels.triton_attention, or None (turned off, refused, or Triton does not import)."""
    if os.environ.get(TRITON_ENV, "1") == "0" or _refusals:
        return None
    try:
        from shard.kernels import triton_attention
    except ImportError as err:  # CPU builds of PyTorch come without Triton
        log.info("no Triton (%s): CUDA decode attention gathers each context in PyTorch", err)
        return None
    return triton_attention


def select(device: torch.device, cache_dtype: torch.dtype) -> str | None:
    """The kernel of decode attention over a cache of this device and dtype: C, TRITON or None."""
    if device.type == "cpu":
        return C if paged_attention.supports(device, cache_dtype) else None
    if device.type == "cuda" and cache_dtype in TRITON_CACHE_DTYPES and triton_kernel() is not None:
        return TRITON
    return None


def select_checked(spec, model: torch.nn.Module) -> str | None:
    """`select`'s kernel for the cache of `spec` (a KVCacheSpec), Triton's once it runs right here.

    On CUDA, Triton's kernels are first called on the model's attention shapes and compared with
    PyTorch (shard.kernels.triton_probe); where one fails, none is used."""
    kernel = select(spec.device, spec.cache_dtype)
    if kernel == TRITON:
        from shard.kernels import triton_probe
        reason = triton_probe.problem(triton_probe.attention_shapes(model), spec.block_size,
                                      spec.dtype, spec.int8, spec.device)
        if reason is not None:
            log.warning("Triton's kernels are not used (%s): attention gathers each context "
                        "and the layer ops run in PyTorch", reason)
            refuse_triton(reason)
            kernel = select(spec.device, spec.cache_dtype)
    return kernel


def cache_refusal(device: torch.device, cache_dtype: torch.dtype, kernel: str | None, *,
                  compile_decode: bool, cuda_graphs: bool) -> str | None:
    """Why a KV cache of `cache_dtype` cannot be read on `device` by `kernel` (select's), or None.

    An int8 cache is read by the C kernels on the CPU and by Triton's on CUDA (decode, prefill
    over a cached prefix, and the CUDA graphs over them); on CUDA without Triton's kernels it is
    refused, not gathered and dequantized a step at a time. `cuda_graphs`: graphs are captured."""
    if cache_dtype != torch.int8:
        return None
    refusal = device_refusal(device.type, kv_cache_dtype="int8")
    if refusal is None and device.type == "cuda" and kernel != TRITON:
        why = (f"they failed their check here: {triton_refused()}" if triton_refused() else
               f"Triton does not import, or {TRITON_ENV}=0")
        refusal = ("--kv-cache-dtype int8 on CUDA is read by Triton's attention kernels, which do "
                   f"not run here ({why}): install Triton (PyTorch's CUDA builds bring it) or "
                   "serve without --kv-cache-dtype")
    return refusal or decode_path_refusal("int8", compile_decode=compile_decode,
                                          cuda_graphs=cuda_graphs and kernel != TRITON)


def prefill_kernel(device: torch.device, cache_dtype: torch.dtype) -> ModuleType | None:
    """shard.kernels.triton_prefill where prefill reads cached prefixes in place, or None.

    Where Triton's decode kernel runs (CUDA, a cache it reads): the two are selected together."""
    if select(device, cache_dtype) != TRITON:
        return None
    from shard.kernels import triton_prefill
    return triton_prefill


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           **options) -> torch.Tensor:
    """The decode attention of the kernel for q's device (the C one's contract and options)."""
    kernel = triton_kernel() if q.device.type == "cuda" else paged_attention
    return kernel.paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens,
                                         scale, **options)
