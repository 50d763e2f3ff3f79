"""Which dtype the arithmetic runs in: bfloat16 where the CPU computes it, float32 where it only stores it."""
from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_bf16_kernels() -> bool:
    """True where oneDNN has bf16 matmul kernels (AVX-512 BF16, AMX, AVX-NE-CONVERT); on AVX2-only
    CPUs PyTorch emulates bf16 matmuls, 3-5x slower than float32."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except (AttributeError, RuntimeError):
        return False
    return True


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to multiply tensors stored as `dtype` in: bf16 data is widened on CPUs without
    bf16 kernels (exact: every bf16 value is a float32 value)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16_kernels():
        return torch.float32
    return dtype
