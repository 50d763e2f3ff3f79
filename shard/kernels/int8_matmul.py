"""The C int8 matmul (shard/kernels/int8_matmul.c) on AVX-512 BF16 or AVX2 CPUs.

Its weights are grouped 8-bit grids, w = q * scale + low per group of 16 or 32 inputs, the form
GGUF's 5-, 6- and 8-bit types stand for (shard.layers.ggml_quants.Groups). On AVX-512 BF16
decode-size batches multiply by it in integers, their rows rounded to int16 a group, and larger
ones by the bf16 matmul's tiles over blocks unpacked on the fly (the bf16 of `restore`'s weights);
on AVX2 every batch multiplies by it in float32, the rows as they are.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.kernels import bf16_matmul, native

SOURCE = native.KERNELS / "int8_matmul.c"
# no fused multiply-adds the source does not ask for: an unpacked weight is q * scale, rounded, plus
# the low, as `restore` computes it
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off"]
ENABLED_ENV = "TGI_PY_INT8_KERNEL"
GROUPS = (16, 32)
# what int8_matmul_supported says: VDPBF16PS dot products, or float32 FMAs on AVX2
DPBF16_FORM, AVX2_FORM = 1, 2


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The library where it has a kernel for this CPU, else None."""
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "8-bit layers multiply by the weights their groups stand for")
    if library is None or not library.int8_matmul_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.int8_matmul_packed_bytes.argtypes = [i64, i64, i64]
    library.int8_matmul_packed_bytes.restype = i64
    library.int8_matmul_pack.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
    library.int8_matmul_pack.restype = None
    library.int8_matmul.argtypes = bf16_matmul.MATMUL_ARGTYPES
    library.int8_matmul.restype = ctypes.c_int
    library.int8_matmul_tile_rows.restype = ctypes.c_int
    return library


def restore(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight q * scale + low stands for (the product rounded, then the sum)."""
    n, k = q.shape
    groups = q.reshape(n, k // group, group).float() * scale[..., None] + low[..., None]
    return groups.reshape(n, k)


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's layout of q [n, k] (integers in -128..127), scale and low [n, k / group].

    Flat bytes, a header first that records the group, k and n."""
    n, k = q.shape
    if group not in GROUPS or k == 0 or k % group or n == 0:
        raise ValueError(f"a {n} x {k} weight is not whole groups of 16 or 32 (group {group})")
    if scale.shape != (n, k // group) or low.shape != (n, k // group):
        raise ValueError(f"scale and low are [{n}, {k // group}], not {tuple(scale.shape)} and "
                         f"{tuple(low.shape)}")
    if q.dtype != torch.int8:
        if q.dtype.is_floating_point or int(q.min()) < -128 or int(q.max()) > 127:
            raise ValueError("q holds integers in -128..127")
        q = q.to(torch.int8)
    library = load_library()
    packed = torch.empty(library.int8_matmul_packed_bytes(n, k, group), dtype=torch.uint8)
    # held: a temporary copy would be freed before the C call reads it
    held = q.contiguous(), scale.float().contiguous(), low.float().contiguous()
    library.int8_matmul_pack(held[0].data_ptr(), held[1].data_ptr(), held[2].data_ptr(), n, k,
                             group, packed.data_ptr())
    return packed


def tile_rows() -> int | None:
    """Up to how many rows a call multiplies by the 8-bit form (more: by unpacked bf16 blocks).

    None where every batch does (AVX2)."""
    return load_library().int8_matmul_tile_rows() or None


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The C int8 linear layer: x [..., k] -> x W^T + bias [..., n], for W packed by `pack`.

    bias is contiguous bf16 or None; x is rounded to bf16 first, the result comes back in x's dtype.
    Past `tile_rows()` rows the result is the bf16 matmul's on the bf16 of `restore`'s weights, bit
    for bit; up to it, on AVX-512, each row is first rounded to int16 a group (to 1/32767 of the
    group's largest magnitude). A k or n other than the packed weight's is a ValueError."""
    return bf16_matmul.run_on_rows(load_library().int8_matmul, x, packed, n, bias)
