"""Weight-only int8 and int4 forms of a linear weight, multiplied by PyTorch's packed CPU kernels.

A small batch's step is bound by reading the weights, so fewer bytes per weight is a faster
step. Activations stay in floating point.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shard.config import CPU_QUANTIZE_KINDS
from shard.kernels import int4_matmul

if TYPE_CHECKING:
    from shard.layers.int8_dynamic import DynamicInt8

QUANTIZE_KINDS = CPU_QUANTIZE_KINDS  # this module's forms (fp8's: shard.layers.fp8)

# int8: one scale per output row, symmetric (w = q * scale, q in [-127, 127]). int4: one scale
# and one offset per group of INT4_GROUP input features of a row, asymmetric (w = (q - 8) * scale
# + zero, q in [0, 15]): the layout of GGUF's Q4_1 blocks
INT4_GROUP = 32
# the CPU kernel's packing of int4 weights takes output features in tiles of this many rows
_INT4_ROW_TILE = 16


@dataclass(slots=True)
class QuantizedWeight:
    kind: str
    # int8 [out, in], or the kernel's packed int4 form; None (and no scales) where the kernels
    # never run here, the layer multiplying by the weights the form stands for; "fbgemm":
    # fbgemm's packed weight (int8_dynamic.DynamicInt8)
    data: torch.Tensor | DynamicInt8 | None
    scales: torch.Tensor | None  # int8: [out]; int4: [in / group, out, 2] (scale, zero); C: None
    out_features: int
    dtype: torch.dtype  # what the kernel takes and gives: the scales' dtype
    # "pytorch": the packed kernels above; "c": int4 in shard.kernels.int4_matmul's form (its
    # scales and minimums inside `data`); "c8": a GGUF's 5-, 6- and 8-bit groups in
    # shard.kernels.int8_matmul's form; "fp8": float8 [out, in] and float32 scales [out]
    # (shard.layers.fp8), on any device; "fbgemm": an encoder's int8, weights and activations
    # (shard.layers.int8_dynamic)
    kernel: str = "pytorch"


def quantize(weight: torch.Tensor, kind: str, dtype: torch.dtype
             ) -> tuple[QuantizedWeight, torch.Tensor]:
    """`weight` [out, in] in `kind`'s form, and the float32 weight that form stands for.

    The form is multiplied in `dtype` (bf16 or float32); the float32 weight has the scales rounded
    to `dtype` as the kernel reads them."""
    if kind == "int8":
        return _int8(weight.float(), dtype)
    if kind == "int4":
        return _int4(weight.float(), dtype)
    raise ValueError(f"unknown weight quantization {kind!r}: {', '.join(QUANTIZE_KINDS)}")


def can_quantize(weight: torch.Tensor, kind: str) -> bool:
    """Whether `kind`'s kernel takes this weight's shape.

    int4 groups must tile the input features, and the int8 kernel reads past the end of rows whose
    input features are not a multiple of 16 (wrong values or a crash, seen for 8, 20, 40, ...): both
    are held to multiples of 32."""
    if weight.shape[1] % INT4_GROUP:
        return False
    return kind != "int4" or weight.shape[0] % _INT4_ROW_TILE == 0


def _int8(weight: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale = scale.to(dtype)
    restored = q.float() * scale.float()[:, None]
    return QuantizedWeight("int8", q.contiguous(), scale, weight.shape[0], dtype), restored


def _int4(weight: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.view(out_features, in_features), 1)
    # the kernel computes (q - 8) * scale + zero
    scale, zero = scale.to(dtype), (low + 8 * scale).to(dtype)
    restored = ((q - 8).float() * scale.float() + zero.float()).view(out_features, in_features)
    scales = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return QuantizedWeight("int4", packed, scales, out_features, dtype), restored


def c_int4(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` [out, in] in the C int4 kernel's form.

    A float32 scale and minimum per group of 32, GGUF's Q4_1 layout; int4_matmul.restore gives the
    weight it stands for."""
    q, scale, low = int4_matmul.quantize(weight)
    return QuantizedWeight("int4", int4_matmul.pack(q, scale, low), None, weight.shape[0],
                           torch.bfloat16, kernel="c")


def quantized_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """A quantized linear layer by PyTorch's kernels: x [rows, in] -> x W^T [rows, out].

    In x's dtype. A form in our C int4 kernel's layout multiplies through shard.layers.linear
    instead."""
    inputs = x.to(w.dtype).contiguous()
    if w.kind == "int8":
        out = torch.ops.aten._weight_int8pack_mm(inputs, w.data, w.scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(inputs, w.data, INT4_GROUP, w.scales)
    return out.to(x.dtype)


def dequantize(w: QuantizedWeight, in_features: int) -> torch.Tensor:
    """The float32 weight the kernel multiplies by (for tests and quality checks)."""
    eye = torch.eye(in_features, dtype=w.dtype)
    return quantized_linear(eye, w).float().T.contiguous()
