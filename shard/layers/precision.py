"""Which dtype the arithmetic runs in.

bfloat16 where the CPU (or our C matmul) computes it, float32 where it only stores it."""
from __future__ import annotations

import functools

import torch

from shard.kernels import bf16_matmul


@functools.cache
def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU.

    It takes bf16 weights on AVX-512 (BW/VL/DQ) and AVX-NE-CONVERT CPUs, with native bf16 products
    on AVX-512 BF16 and AMX; AVX2-only CPUs emulate bf16 matmuls, several times slower than float32.
    Tests force it by patching this name (linear.py holds its own reference, as the oneDNN prepack
    cannot be forced)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except (AttributeError, RuntimeError):
        return False
    return True


def c_matmul_runs() -> bool:
    """Whether bf16 linear layers run our C matmul (shard.kernels.bf16_matmul) here.

    Its AVX-512 BF16 form wherever it builds (not on AMX CPUs), its AVX2 form only where oneDNN has
    no bf16 kernels (AVX2-only CPUs: it was measured against the float32 arithmetic they use
    otherwise, not against oneDNN's bf16 kernels on AVX-512 CPUs without BF16). Tests force it by
    patching this name, here and in shard.layers.linear."""
    library = bf16_matmul.load_library()
    return library is not None and (library.bf16_matmul_supported() == bf16_matmul.DPBF16_FORM
                                    or not cpu_has_bf16_kernels())


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype PyTorch's own matmuls (attention's) multiply tensors stored as `dtype` in.

    bf16 data is widened on CPUs without bf16 kernels (exact: every bf16 value is a float32 value).
    """
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16_kernels():
        return torch.float32
    return dtype


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model stored as `dtype` holds its hidden states in.

    bf16 where its matmuls run in bf16 (oneDNN's kernels, or our C matmul, which takes bf16 rows on
    AVX2 too), else the float32 of `compute_dtype`, so that no layer converts its input or output.
    """
    if dtype == torch.bfloat16 and device.type == "cpu" and c_matmul_runs():
        return dtype
    return compute_dtype(dtype, device)


def attention_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype,
                    device: torch.device) -> torch.dtype:
    """The dtype attention multiplies queries and keys/values in when their dtypes may differ.

    The wider of the two (a float32 query over a bf16 cache computes in float32: widening the cache
    is exact, narrowing the query would round it), then `compute_dtype` of that. Callers return
    their output in the query's dtype, the activations' dtype."""
    return compute_dtype(torch.promote_types(query_dtype, cache_dtype), device)
