"""The C int4 matmul (shard/kernels/int4_matmul.c) on AVX-512 BF16 or AVX2 CPUs.

`--quantize int4` layers of a bf16 model hold its form alone (GGUF's Q4_1 groups). On AVX-512 VNNI
(every CPU with AVX-512 BF16 so far) and on AVX2 every batch multiplies by it in integers, its rows
rounded to int8 a group of 32 inputs, as llama.cpp rounds its activations; on an AVX-512 BF16 CPU
without VNNI decode-size batches multiply by it directly and larger ones by the bf16 matmul's tiles
over blocks unpacked on the fly (`restore`'s weights).

The factors of the 4-bit values come in three modes, each with its pack and restore (the weights a
packed buffer stands for, in float32): F (`pack`), float32 scale and low a group of 32, any values,
6 bits a weight; K (`pack_k`), GGUF's Q4_K as stored, 6-bit sc and m a group and float32 d and dmin
a superblock of 256 (4.75 bits); H (`pack_half`), float16 scale and low a group, Q4_0's and Q4_1's
(5 bits).
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
# mode K's superblock of inputs (Q4_K's): one d and dmin for 8 groups
SUPERBLOCK = 256
# the header's modes
MODE_F, MODE_K, MODE_H = 0, 1, 2
# what int4_matmul_supported says: VDPBF16PS dot products, or integer dot products on AVX2 or on
# AVX-512 VNNI
DPBF16_FORM, AVX2_FORM, VNNI_FORM = 1, 2, 3


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The library where it has a kernel for this CPU, else None."""
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "int4 layers multiply by the weights their 4-bit form stands for")
    if library is None or not library.int4_matmul_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.int4_matmul_packed_bytes.argtypes = [i64, i64, i64]
    library.int4_matmul_packed_bytes.restype = i64
    library.int4_matmul_pack.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    library.int4_matmul_pack.restype = None
    library.int4_matmul_pack_half.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    library.int4_matmul_pack_half.restype = None
    library.int4_matmul_pack_k.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ptr]
    library.int4_matmul_pack_k.restype = None
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


def k_factors(d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
              m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mode K's scale d * sc and low -(dmin * m) per group of 32, in float32 (as the kernel's)."""
    times = SUPERBLOCK // GROUP
    scale = d.float().repeat_interleave(times, dim=1) * sc.float()
    return scale, -(dmin.float().repeat_interleave(times, dim=1) * m.float())


def restore_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
              m: torch.Tensor) -> torch.Tensor:
    """The float32 weight `pack_k`'s factors stand for: gguf's Q4_K dequantization, bit for bit."""
    return restore(q, *k_factors(d, sc, dmin, m))


def restore_half(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight `pack_half`'s float16 factors stand for, widened exactly."""
    return restore(q, scale.float(), low.float())


def _packed(n: int, k: int, mode: int) -> torch.Tensor:
    """An empty buffer of the bytes a mode's n x k weight packs into."""
    size = load_library().int4_matmul_packed_bytes(n, k, mode)
    if size < 0:
        whole = SUPERBLOCK if mode == MODE_K else GROUP
        raise ValueError(f"a {n} x {k} weight is not whole groups of {whole} inputs")
    return torch.empty(size, dtype=torch.uint8)


def _codes(q: torch.Tensor,
           *factors: tuple[torch.Tensor, tuple[int, int], int | None]) -> torch.Tensor:
    """q as contiguous uint8 in 0..15, each factor checked for its shape and (bytes) range."""
    for tensor, shape, top in ((q, q.shape, 15), *factors):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"factors of a {tuple(q.shape)} q are {shape}, not "
                             f"{tuple(tensor.shape)}")
        if top is not None and tensor.numel() and (
                tensor.dtype.is_floating_point or int(tensor.min()) < 0 or int(tensor.max()) > top):
            raise ValueError(f"q holds integers in 0..15, sc and m in 0..63, not {tensor.dtype} "
                             f"{float(tensor.min())}..{float(tensor.max())}")
    return q.to(torch.uint8).contiguous()


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Mode F: the kernel's layout of (q, scale, low) from `quantize`, flat bytes (header first)."""
    n, k = q.shape
    packed = _packed(n, k, MODE_F)
    groups = (n, k // GROUP)
    # held: a temporary copy would be freed before the C call reads it
    held = (_codes(q, (scale, groups, None), (low, groups, None)), scale.float().contiguous(),
            low.float().contiguous())
    load_library().int4_matmul_pack(*(t.data_ptr() for t in held), n, k, packed.data_ptr())
    return packed


def pack_half(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Mode H: q [n, k] (0..15) with float16 scale and low [n, k / 32] (Q4_1's; Q4_0's low -8d)."""
    n, k = q.shape
    packed = _packed(n, k, MODE_H)
    groups = (n, k // GROUP)
    if scale.dtype != torch.float16 or low.dtype != torch.float16:
        raise ValueError(f"mode H's factors are float16, not {scale.dtype} and {low.dtype}")
    held = (_codes(q, (scale, groups, None), (low, groups, None)),
            scale.contiguous().view(torch.int16), low.contiguous().view(torch.int16))
    load_library().int4_matmul_pack_half(*(t.data_ptr() for t in held), n, k, packed.data_ptr())
    return packed


def pack_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
           m: torch.Tensor) -> torch.Tensor:
    """Mode K: q [n, k] (0..15), d and dmin [n, k / 256], sc and m [n, k / 32] (0..63): Q4_K's.

    d and dmin are float32 (a float16's value, for `restore_k`'s products to be exact)."""
    n, k = q.shape
    packed = _packed(n, k, MODE_K)
    groups, supers = (n, k // GROUP), (n, k // SUPERBLOCK)
    codes = _codes(q, (d, supers, None), (dmin, supers, None), (sc, groups, 63), (m, groups, 63))
    held = (codes, d.float().contiguous(), sc.to(torch.uint8).contiguous(),
            dmin.float().contiguous(), m.to(torch.uint8).contiguous())
    load_library().int4_matmul_pack_k(*(t.data_ptr() for t in held), n, k, packed.data_ptr())
    return packed


def packed_mode(packed: torch.Tensor) -> int:
    """Which mode's factors a packed weight holds (its header's)."""
    return int(packed[:16].view(torch.int64)[1])


def tile_rows() -> int | None:
    """Up to how many rows a call multiplies by the 4-bit form (more: by unpacked bf16 blocks).

    None where every batch does (the integer tiles of AVX2 and AVX-512 VNNI)."""
    return load_library().int4_matmul_tile_rows() or None


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The C int4 linear layer: x [..., k] -> x W^T + bias [..., n], W packed in any mode.

    bias is contiguous bf16 or None; x is rounded to bf16 first, the result comes back in x's dtype.
    Past `tile_rows()` rows the result is the bf16 matmul's on the bf16 of the weights the mode's
    restore gives, bit for bit. With integer tiles (AVX2, AVX-512 VNNI) every row is first rounded
    to int8 a group of 32 inputs (to 1/127 of the group's largest magnitude), as llama.cpp's 4-bit
    matmuls round theirs, and a row's result does not depend on the batch. A k or n other than the
    packed weight's is a ValueError."""
    return bf16_matmul.run_on_rows(load_library().int4_matmul, x, packed, n, bias)
