"""The C bf16 matmul (shard/kernels/bf16_matmul.c) for CPUs with AVX-512 BF16 or AVX2.

Built on first use; where it runs (shard.layers.precision.c_matmul_runs), bf16 linear layers keep
their weights in its packed layout (shard.layers.linear).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.kernels import native

SOURCE = native.KERNELS / "bf16_matmul.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
ENABLED_ENV = "TGI_PY_MATMUL_KERNEL"
# what bf16_matmul_supported says: VDPBF16PS dot products, or float32 FMAs on AVX2
DPBF16_FORM, AVX2_FORM = 1, 2
# x, m, k, x_stride, packed, n, bias, out, out_stride: the signature of both C matmuls (this one's
# and the int4 kernel's), as run_on_rows calls them; they return 0, -1 (no kernel in the build, or
# a shape it does not take) or -2 (their scratch could not be allocated)
MATMUL_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64]


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The library where it has a kernel for this CPU (either form), else None."""
    if " amx_bf16" in native.cpu_flags():
        return None
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "bf16 linear layers use oneDNN's prepacked matmul")
    if library is None or not library.bf16_matmul_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.bf16_matmul_packed_elements.argtypes = [i64, i64]
    library.bf16_matmul_packed_elements.restype = i64
    library.bf16_matmul_pack.argtypes = [ptr, i64, i64, ptr]
    library.bf16_matmul_pack.restype = None
    library.bf16_matmul.argtypes = MATMUL_ARGTYPES
    library.bf16_matmul.restype = ctypes.c_int
    return library


def can_pack(weight: torch.Tensor) -> bool:
    """Whether the kernel, where it runs, takes this weight."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0 and weight.shape[0] > 0
            and load_library() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] -> the kernel's layout of it (flat bf16)."""
    n, k = weight.shape
    library = load_library()
    packed = torch.empty(library.bf16_matmul_packed_elements(n, k), dtype=torch.bfloat16)
    source = weight.contiguous()  # held: a temporary copy would be freed before the C call reads it
    library.bf16_matmul_pack(source.data_ptr(), n, k, packed.data_ptr())
    return packed


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The C bf16 linear layer: x [..., k] -> x W^T + bias [..., n], for W packed by `pack`.

    bias is contiguous bf16 or None; the arithmetic is bf16's (an input of another dtype is rounded
    to bf16 first), the result in x's dtype."""
    if torch.compiler.is_compiling():
        return bf16_matmul_op(x, packed, n, bias)
    return run_on_rows(load_library().bf16_matmul, x, packed, n, bias)


def run_on_rows(kernel, x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """A C matmul with bf16_matmul's signature run over x [..., k] -> [..., n].

    The kernel is this one's or the int4 kernel's: x's rows are rounded to bf16 and made contiguous
    where they are not, the result comes back in x's dtype. A shape the kernel does not take is a
    ValueError, scratch it could not allocate a MemoryError."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(torch.bfloat16)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != k):
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    status = kernel(rows.data_ptr(), rows.shape[0], k, k, packed.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n)
    if status == -1:
        raise ValueError(f"a C matmul does not take {rows.shape[0]} x {k} rows against its weight")
    if status != 0:
        raise MemoryError(f"a C matmul could not allocate its scratch for {rows.shape[0]} x {k} "
                          "rows")
    return out.to(x.dtype)


@torch.library.custom_op("tgi::bf16_matmul", mutates_args=())
def bf16_matmul_op(x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """`matmul` as an operator: what a compiled step calls.

    A compiler cannot see into the kernel's raw pointers."""
    return matmul(x, packed, n, bias)


@bf16_matmul_op.register_fake
def _(x, packed, n, bias):
    return x.new_empty(*x.shape[:-1], n)
