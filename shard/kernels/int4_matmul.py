"""The C int4 matmul (shard/kernels/int4_matmul.c) on AVX-512 BF16 or AVX2 CPUs.

`--quantize int4` layers of a bf16 model hold its form alone (GGUF's Q4_1 groups). On AVX-512 BF16
decode-size batches multiply by it directly and larger ones by the bf16 matmul's tiles over blocks
unpacked on the fly (`restore`'s weights); on AVX2 every batch multiplies by it in integers, its
rows rounded to int8.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.kernels import bf16_matmul, native

SOURCE = native.KERNELS / "int4_matmul.c"
# no fused multiply-adds the source does not ask for: an unpacked weight is q * scale, rounded, plus
# the minimum, as `restore` computes it
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off"]
ENABLED_ENV = "TGI_PY_INT4_KERNEL"
GROUP = 32
# what int4_matmul_supported says: VDPBF16PS dot products, or integer dot products on AVX2
DPBF16_FORM, AVX2_FORM = 1, 2


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The library where it has a kernel for this CPU, else None."""
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "int4 layers multiply by the weights their 4-bit form stands for")
    if library is None or not library.int4_matmul_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.int4_matmul_packed_bytes.argtypes = [i64, i64]
    library.int4_matmul_packed_bytes.restype = i64
    library.int4_matmul_pack.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    library.int4_matmul_pack.restype = None
    library.int4_matmul.argtypes = bf16_matmul.MATMUL_ARGTYPES
    library.int4_matmul.restype = ctypes.c_int
    library.int4_matmul_tile_rows.restype = ctypes.c_int
    return library


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's 4-bit groups: weight [n, k] -> (q, scale, low), weight ~ q * scale + low per 32.

    k is a multiple of 32; q [n, k] uint8 in 0..15, scale and low [n, k / 32] float32 (the minimum
    and 1/15 of the range of each group of 32). No q * scale + low is subnormal (the kernel's bf16
    rounding flushes those): a subnormal minimum stands as 0, and a scale is at least 1e-12."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low = groups.amin(dim=-1)
    low = torch.where(low.abs() < torch.finfo(torch.float32).tiny, 0.0, low)
    scale = ((groups.amax(dim=-1) - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k).contiguous(), scale.contiguous(), low.contiguous()


def restore(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight q * scale + low stands for (the product rounded, then the sum)."""
    n, k = q.shape
    groups = q.reshape(n, k // GROUP, GROUP).float() * scale[..., None] + low[..., None]
    return groups.reshape(n, k)


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of (q, scale, low) from `quantize`: flat bytes."""
    n, k = q.shape
    library = load_library()
    packed = torch.empty(library.int4_matmul_packed_bytes(n, k), dtype=torch.uint8)
    held = q.contiguous(), scale.float().contiguous(), low.float().contiguous()
    library.int4_matmul_pack(held[0].data_ptr(), held[1].data_ptr(), held[2].data_ptr(), n, k,
                             packed.data_ptr())
    return packed


def tile_rows() -> int | None:
    """Up to how many rows a call multiplies by the 4-bit form (more: by unpacked bf16 blocks).

    None where every batch does (AVX2's integer tiles)."""
    return load_library().int4_matmul_tile_rows() or None


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The C int4 linear layer: x [..., k] -> x W^T + bias [..., n], for W packed by `pack`.

    bias is contiguous bf16 or None; x is rounded to bf16 first, the result comes back in x's dtype.
    Past `tile_rows()` rows the result is the bf16 matmul's on the bf16 of `restore`'s weights, bit
    for bit. On AVX2 every row is first rounded to int8 a group of 32 inputs (to 1/127 of the
    group's largest magnitude), as llama.cpp's 4-bit matmuls round theirs."""
    return bf16_matmul.run_on_rows(load_library().int4_matmul, x, packed, n, bias)
