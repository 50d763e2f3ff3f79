"""Quantized parts of a linear layer packed for our C int4 or int8 kernel, their weights exactly.

A GGUF's parts of one factor mode keep their own factors (ggml_factors: about the file's bytes);
others (a fused projection mixing modes, a checkpoint's groups) take the kernels' float32
(scale, low) per group, mode F.
"""
from __future__ import annotations

import torch

from shard.kernels import int4_matmul, int8_matmul
from shard.layers.ggml_factors import CompactFactors, compact_factors
from shard.layers.ggml_quants import BlockRows, BlockStack
from shard.layers.quantize import QuantizedWeight


def _compact(stack: BlockStack) -> CompactFactors | None:
    """The parts' factors stacked, where every part is a GGUF's blocks of one compact mode."""
    if not all(isinstance(part, BlockRows) for part in stack.parts):
        return None
    factors = [compact_factors(part) for part in stack.parts]
    if any(f is None for f in factors) or len({f.mode for f in factors}) != 1:
        return None
    names = set().union(*(f.fields for f in factors))
    if any(set(f.fields) != names for f in factors) and names != {"scale", "low"}:
        return None
    fields = {}
    for name in names:  # a part without a low (Q8_0 beside Q5_1) has zeros there
        fields[name] = torch.cat([f.fields[name] if name in f.fields
                                  else torch.zeros_like(f.fields["scale"]) for f in factors])
    return CompactFactors(factors[0].mode, torch.cat([f.q for f in factors]), fields)


def _int4(stack: BlockStack, compact: CompactFactors | None) -> torch.Tensor | None:
    if compact is not None and compact.mode == "k":
        f = compact.fields
        return int4_matmul.pack_k(compact.q.to(torch.uint8), f["d"], f["sc"], f["dmin"], f["m"])
    if compact is not None and compact.mode == "half" and "low" in compact.fields:
        f = compact.fields
        return int4_matmul.pack_half(compact.q.to(torch.uint8), f["scale"], f["low"])
    groups = stack.groups()
    if groups.group % 32:
        return None
    groups = groups.regrouped(32)
    return int4_matmul.pack(groups.q.to(torch.uint8), groups.scale, groups.low)


def _int8(stack: BlockStack, compact: CompactFactors | None) -> torch.Tensor | None:
    if compact is not None:
        f = compact.fields
        if compact.mode == "k":
            return int8_matmul.pack_k5(compact.q, f["d"], f["sc"], f["dmin"], f["m"])
        if compact.mode == "k6":
            return int8_matmul.pack_k6(compact.q, f["d"], f["sc"])
        return int8_matmul.pack_half(compact.q, f["scale"], 32, f.get("low"))
    groups = stack.groups()
    if groups.group % 32 == 0:
        groups = groups.regrouped(32)
    if groups.group not in int8_matmul.GROUPS:
        return None
    return int8_matmul.pack(groups.q, groups.scale, groups.low, groups.group)


def kernel_form(stack: BlockStack, *, int4: bool, int8: bool) -> QuantizedWeight | None:
    """The stack in the int4 kernel's form or the int8 kernel's; None where neither fits.

    int4 where every part is 4-bit, else int8 for integer grids of up to 8 bits, as far as those
    kernels run here (`int4`, `int8`)."""
    if not all(0 < part.bits <= 8 for part in stack.parts):
        return None
    compact = _compact(stack)
    if int4 and all(part.bits == 4 for part in stack.parts):
        packed = _int4(stack, compact)
        if packed is not None:
            return QuantizedWeight("int4", packed, None, stack.rows, torch.bfloat16, kernel="c")
    if int8:
        packed = _int8(stack, compact)
        if packed is not None:
            return QuantizedWeight("int8", packed, None, stack.rows, torch.bfloat16, kernel="c8")
    return None
