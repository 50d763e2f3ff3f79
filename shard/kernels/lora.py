"""The C LoRA kernel (shard/kernels/lora.c): each bf16 row's own adapter update, added in place.

The update is that of the row's adapter slot, added to a linear layer's output; the kernel is built
on first use. Where it does not build (or TGI_PY_LORA_KERNEL=0) shard.layers.lora computes the
updates in PyTorch.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.kernels import native

SOURCE = native.KERNELS / "lora.c"
# no contraction of a * b + c into an FMA but the kernel's own: a row's bits must not depend on
# which of its code paths (vector lane, scalar tail) computed an element
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
ENABLED_ENV = "TGI_PY_LORA_KERNEL"

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def load_library() -> ctypes.CDLL | None:
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV, "LoRA updates run in PyTorch")
    if library is None:
        return None
    # x, rows, in, x_stride, row_slots, a, bt, ranks, num_slots, max_rank, width, out, out_stride
    library.lora_add.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                 _ptr, _i64]
    library.lora_add.restype = ctypes.c_int
    return library


def add(x: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor, a: torch.Tensor,
        bt: torch.Tensor, ranks: torch.Tensor, offset: int, width: int) -> None:
    """Each row's adapter update added in place to a linear layer's output.

    out[i, offset:offset + width] += sum_{r < ranks[s]} (x[i] . a[s, r]) bt[s, r], s =
    row_slots[i], in place (float32 sums, one rounding to bf16); rows whose slot is -1 (or any
    slot outside a's) are left as they are.

    x bf16 [rows, in] (its rows may be strided), out bf16 [rows, n] (the linear layer's whole
    output, its rows strided at most), row_slots int64 [rows], a bf16 [slots, rank, in] and bt
    bf16 [slots, rank, width] contiguous, ranks int64 [slots]. ValueError for tensors that do
    not fit those, MemoryError where the kernel could not allocate its scratch."""
    _check(x, out, row_slots, a, bt, ranks, offset, width)
    if x.stride(1) != 1:
        x = x.contiguous()
    row_slots = row_slots.contiguous()
    ranks = ranks.contiguous()
    rows = x.shape[0]
    status = load_library().lora_add(
        x.data_ptr(), rows, x.shape[1], x.stride(0), row_slots.data_ptr(), a.data_ptr(),
        bt.data_ptr(), ranks.data_ptr(), a.shape[0], a.shape[1], width,
        out.data_ptr() + offset * out.element_size(), out.stride(0))
    if status != 0:
        raise MemoryError(f"the LoRA kernel could not allocate its scratch for {rows} rows")


def _check(x: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor, a: torch.Tensor,
           bt: torch.Tensor, ranks: torch.Tensor, offset: int, width: int) -> None:
    """The check that tensors fit the kernel, which reads and writes through raw pointers.

    Anything that does not fit is refused here, cheaply: the eager layers call this for every part
    of every projection."""
    bf16, i64 = torch.bfloat16, torch.int64
    if not (x.dtype == out.dtype == a.dtype == bt.dtype == bf16
            and row_slots.dtype == ranks.dtype == i64):
        raise ValueError(f"LoRA kernel: x, out, a, bt ({x.dtype}, {out.dtype}, {a.dtype}, "
                         f"{bt.dtype}) must be bf16 and row_slots, ranks ({row_slots.dtype}, "
                         f"{ranks.dtype}) int64")
    if not (x.is_cpu and out.is_cpu and a.is_cpu and bt.is_cpu and row_slots.is_cpu
            and ranks.is_cpu):
        raise ValueError("LoRA kernel: every tensor must be on the CPU")
    if (x.dim() != 2 or out.dim() != 2 or row_slots.shape != (x.shape[0],)
            or out.shape[0] != x.shape[0]):
        raise ValueError(f"LoRA kernel: x {tuple(x.shape)}, out {tuple(out.shape)} and row_slots "
                         f"{tuple(row_slots.shape)} are not [rows, in], [rows, n] and [rows]")
    if out.stride(1) != 1:
        raise ValueError("LoRA kernel: out's columns are not contiguous (it is written in place)")
    if offset < 0 or width <= 0 or offset + width > out.shape[1]:
        raise ValueError(f"LoRA kernel: columns {offset}..{offset + width} are not within out's "
                         f"{out.shape[1]}")
    if (a.dim() != 3 or a.shape[2] != x.shape[1] or bt.shape != (a.shape[0], a.shape[1], width)
            or ranks.shape != (a.shape[0],)):
        raise ValueError(f"LoRA kernel: a {tuple(a.shape)}, bt {tuple(bt.shape)} and ranks "
                         f"{tuple(ranks.shape)} are not [slots, rank, {x.shape[1]}], "
                         f"[slots, rank, {width}] and [slots]")
    if not (a.is_contiguous() and bt.is_contiguous()):
        raise ValueError("LoRA kernel: a and bt must be contiguous")
