"""The C int8 matmul (shard/kernels/int8_matmul.c) on AVX-512 BF16 or AVX2 CPUs.

Its weights are grouped 8-bit grids, w = q * scale + low per group of 16 or 32 inputs, the form
GGUF's 5-, 6- and 8-bit types stand for (shard.layers.ggml_quants.Groups). The factors are held
as float32 (`pack`) or in GGUF's own compact forms, the same float32 weights in fewer bytes:
float16 scales (Q8_0, Q5_0: `pack_half`), float16 scales and lows (Q5_1), Q6_K's superblock d
and int8 sc (`pack_k6`), Q5_K's d, dmin and 6-bit sc and m (`pack_k5`). On AVX-512 VNNI (every
AVX-512 BF16 CPU so far) and on AVX2 every batch multiplies by it in integers, the rows rounded to
int8 a group, as llama.cpp rounds its activations (the two forms give the same results, bit for
bit); on an AVX-512 BF16 CPU without VNNI decode-size batches do, their rows rounded to int16 a
group, and larger ones run the bf16 matmul's tiles over blocks unpacked on the fly (the bf16 of
`restore`'s weights).
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
# how a packed weight holds its factors (the header's mode): float32 scale and low; float16 scale;
# float16 scale and low; Q6_K's d and sc; Q5_K's d, sc, dmin and m
MODE_F, MODE_H, MODE_HL, MODE_K6, MODE_K5 = range(5)
# inputs of a Q6_K or Q5_K superblock (one d, and dmin, per feature)
SUPER = 256
# what int8_matmul_supported says: VDPBF16PS dot products, integer dot products on AVX2 (the
# VNNI form's arithmetic), or int8 dot products on AVX-512 VNNI
DPBF16_FORM, AVX2_FORM, VNNI_FORM = 1, 2, 3


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
    library.int8_matmul_packed_bytes_mode.argtypes = [i64, i64, i64, i64]
    library.int8_matmul_packed_bytes_mode.restype = i64
    library.int8_matmul_pack_mode.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    library.int8_matmul_pack_mode.restype = None
    library.int8_matmul.argtypes = bf16_matmul.MATMUL_ARGTYPES
    library.int8_matmul.restype = ctypes.c_int
    library.int8_matmul_tile_rows.restype = ctypes.c_int
    return library


def restore(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight q * scale + low stands for (the product rounded, then the sum)."""
    n, k = q.shape
    groups = q.reshape(n, k // group, group).float() * scale[..., None] + low[..., None]
    return groups.reshape(n, k)


def restore_half(q: torch.Tensor, scale: torch.Tensor, group: int,
                 low: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight `pack_half`'s q and float16 factors stand for.

    q * scale, rounded, plus the low where there is one (none: no sum, as Q8_0's d * q)."""
    n, k = q.shape
    groups = q.reshape(n, k // group, group).float() * scale.float()[..., None]
    if low is not None:
        groups = groups + low.float()[..., None]
    return groups.reshape(n, k)


def k6_scale(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Q6_K's float32 scale per group of 16, d * sc (exact: d is a float16's value) [n, k / 16]."""
    return d.float().repeat_interleave(SUPER // 16, 1) * sc.float()


def k5_factors(d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
               m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K's float32 scale d * sc and low -(dmin * m) per group of 32, [n, k / 32] each."""
    per_super = SUPER // 32
    return (d.float().repeat_interleave(per_super, 1) * sc.float(),
            -(dmin.float().repeat_interleave(per_super, 1) * m.float()))


def restore_k6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """The float32 weight `pack_k6`'s factors stand for: q * (d * sc), no low (Q6_K's)."""
    return restore_half(q, k6_scale(d, sc), 16)


def restore_k5(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
               m: torch.Tensor) -> torch.Tensor:
    """The float32 weight `pack_k5`'s factors stand for: q * (d * sc) - dmin * m (Q5_K's)."""
    scale, low = k5_factors(d, sc, dmin, m)
    return restore(q, scale, low, 32)


def _codes(q: torch.Tensor, lowest: int, highest: int) -> torch.Tensor:
    """q as int8, checked to lie in lowest..highest (int8 is not, for the full range)."""
    if (q.dtype == torch.int8 and (lowest, highest) == (-128, 127)):
        return q.contiguous()
    if q.dtype.is_floating_point or int(q.min()) < lowest or int(q.max()) > highest:
        raise ValueError(f"q holds integers in {lowest}..{highest}")
    return q.to(torch.int8).contiguous()


def _packed(mode: int, q: torch.Tensor, group: int, factors: list) -> torch.Tensor:
    """The C packing of int8 q [n, k] with up to four factor tensors (the C call's a, b, c, d)."""
    n, k = q.shape
    library = load_library()
    size = library.int8_matmul_packed_bytes_mode(n, k, group, mode)
    if size < 0:
        raise ValueError(f"a {n} x {k} weight is not whole groups of {group} for mode {mode}")
    packed = torch.empty(size, dtype=torch.uint8)
    # held: a temporary copy would be freed before the C call reads it
    held = [f.contiguous() if f is not None else None for f in factors]
    pointers = [f.data_ptr() if f is not None else None for f in held]
    pointers += [None] * (4 - len(pointers))
    library.int8_matmul_pack_mode(q.data_ptr(), *pointers, n, k, group, mode, packed.data_ptr())
    return packed


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} is {list(shape)}, not {list(tensor.shape)}")


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's layout of q [n, k] (integers in -128..127), scale and low [n, k / group].

    Flat bytes, a header first that records the group, k and n (mode F: float32 factors)."""
    n, k = q.shape
    if group not in GROUPS or k == 0 or k % group or n == 0:
        raise ValueError(f"a {n} x {k} weight is not whole groups of 16 or 32 (group {group})")
    if scale.shape != (n, k // group) or low.shape != (n, k // group):
        raise ValueError(f"scale and low are [{n}, {k // group}], not {tuple(scale.shape)} and "
                         f"{tuple(low.shape)}")
    return _packed(MODE_F, _codes(q, -128, 127), group, [scale.float(), low.float()])


def pack_half(q: torch.Tensor, scale: torch.Tensor, group: int,
              low: torch.Tensor | None = None) -> torch.Tensor:
    """Modes H and HL: q [n, k] (-128..127) with float16 scale, and low or none, [n, k / group].

    2 or 4 bytes a group and feature where `pack` takes 8: Q8_0 (q, d), Q5_0 (q - 16, d) and Q5_1
    (q, d, m) as GGUF holds them."""
    n, k = q.shape
    if group not in GROUPS or k == 0 or k % group or n == 0:
        raise ValueError(f"a {n} x {k} weight is not whole groups of 16 or 32 (group {group})")
    factors = [scale] if low is None else [scale, low]
    for name, factor in zip(("scale", "low"), factors):
        _check_shape(name, factor, (n, k // group))
        if factor.dtype != torch.float16:
            raise ValueError(f"{name} is float16, not {factor.dtype}")
    return _packed(MODE_H if low is None else MODE_HL, _codes(q, -128, 127), group, factors)


def pack_k6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Mode K6: Q6_K's q [n, k] (-32..31), d [n, k / 256] (float16 values), sc int8 [n, k / 16].

    1 byte a group of 16 and feature, and 4 a superblock."""
    n, k = q.shape
    if k == 0 or k % SUPER or n == 0:
        raise ValueError(f"a {n} x {k} weight is not whole superblocks of {SUPER}")
    _check_shape("d", d, (n, k // SUPER))
    _check_shape("sc", sc, (n, k // 16))
    if sc.dtype != torch.int8:
        raise ValueError(f"sc is int8, not {sc.dtype}")
    return _packed(MODE_K6, _codes(q, -32, 31), 16, [d.float(), sc])


def pack_k5(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor,
            m: torch.Tensor) -> torch.Tensor:
    """Mode K5: Q5_K's q [n, k] (0..31), d and dmin [n, k / 256], sc and m uint8 [n, k / 32].

    d and dmin are float16 values, sc and m 6-bit: 2 bytes a group of 32 and feature, and 8 a
    superblock."""
    n, k = q.shape
    if k == 0 or k % SUPER or n == 0:
        raise ValueError(f"a {n} x {k} weight is not whole superblocks of {SUPER}")
    for name, factor, columns in (("d", d, SUPER), ("dmin", dmin, SUPER), ("sc", sc, 32),
                                  ("m", m, 32)):
        _check_shape(name, factor, (n, k // columns))
    if sc.dtype != torch.uint8 or m.dtype != torch.uint8:
        raise ValueError(f"sc and m are uint8, not {sc.dtype} and {m.dtype}")
    return _packed(MODE_K5, _codes(q, 0, 31), 32, [d.float(), sc, dmin.float(), m])


def tile_rows() -> int | None:
    """Up to how many rows a call multiplies by the 8-bit form (more: by unpacked bf16 blocks).

    None where every batch does (AVX2, AVX-512 VNNI)."""
    return load_library().int8_matmul_tile_rows() or None


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The C int8 linear layer: x [..., k] -> x W^T + bias [..., n], for W packed by `pack`.

    bias is contiguous bf16 or None; x is rounded to bf16 first, the result comes back in x's dtype.
    Past `tile_rows()` rows the result is the bf16 matmul's on the bf16 of `restore`'s weights, bit
    for bit; up to it, on AVX-512 without VNNI, each row is first rounded to int16 a group (to
    1/32767 of the group's largest magnitude). With VNNI, and on AVX2, every row is rounded to int8 a
    group (to 1/127), and a row's result does not depend on the batch. A k or n other than the packed
    weight's is a ValueError."""
    return bf16_matmul.run_on_rows(load_library().int8_matmul, x, packed, n, bias)


# bytes of a group's factors for a block's 16 features, and of a superblock's head, by mode
_FACTOR_BYTES = {MODE_F: 128, MODE_H: 32, MODE_HL: 64, MODE_K6: 16, MODE_K5: 32}
_HEAD_BYTES = {MODE_K6: 64, MODE_K5: 128}
_HEADER_BYTES = 64
_BLOCK = 16
# ids `rows` takes at a time: each gathers its block of 16 features, so temporaries stay near
# 256 x 16 rows' bytes (about 10 MB for a 2,048-wide Q6_K matrix) however long the prompt
_ROWS_AT_ONCE = 256


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the float32 weight a packed form stands for, [len(ids), k]: `restore`'s.

    So that a tied GGUF's embedding looks its rows up in the head's packed form, not a second
    copy of the matrix. Each id gathers its block of 16 features (16 times the row's bytes)."""
    group, k, n, mode = (int(v) for v in packed[:40].view(torch.int64)[1:5])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"rows of a {n}-row weight asked for {ids.min()}..{ids.max()}")
    if ids.numel() > _ROWS_AT_ONCE:
        return torch.cat([rows(packed, part) for part in ids.split(_ROWS_AT_ONCE)])
    per_unit = SUPER // group if mode in _HEAD_BYTES else 1
    group_bytes = _BLOCK * group + _FACTOR_BYTES[mode]
    head = _HEAD_BYTES.get(mode, 0)
    units = k // group // per_unit
    blocks = packed[_HEADER_BYTES:].view(-1, units, head + per_unit * group_bytes)
    ids, m = ids.long(), ids.numel()
    at, lane = torch.arange(m), ids % _BLOCK  # each id's own feature of its block
    picked = blocks[ids // _BLOCK]  # [m, units, unit bytes]
    body = picked[..., head:].reshape(m, units * per_unit, group_bytes)
    # q: [i][f][e] per group; the row's own feature f, inputs 2i + e in order
    q = body[..., :_BLOCK * group].reshape(m, k // group, group // 2, _BLOCK, 2)
    q = q[at, :, :, lane].reshape(m, k).view(torch.int8)
    factors = body[..., _BLOCK * group:].contiguous()

    def factor(dtype: torch.dtype, kinds: int, kind: int) -> torch.Tensor:
        values = factors.view(dtype).reshape(m, units * per_unit, kinds, _BLOCK)
        return values[at, :, kind, lane]

    def superblock(kind: int) -> torch.Tensor:
        values = picked[..., :head].contiguous().view(torch.float32)
        values = values.reshape(m, units, head // 64, _BLOCK)
        return values[at, :, kind, lane]

    if mode == MODE_F:
        return restore(q, factor(torch.float32, 2, 0), factor(torch.float32, 2, 1), group)
    if mode == MODE_H:
        return restore_half(q, factor(torch.float16, 1, 0), group)
    if mode == MODE_HL:
        return restore_half(q, factor(torch.float16, 2, 0), group, factor(torch.float16, 2, 1))
    if mode == MODE_K6:
        return restore_k6(q, superblock(0), factor(torch.int8, 1, 0))
    return restore_k5(q, superblock(0), factor(torch.uint8, 2, 0), superblock(1),
                      factor(torch.uint8, 2, 1))
