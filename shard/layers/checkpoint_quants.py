"""A quantized checkpoint's linear weights as the layers hold them: integer groups, or FP8 values.

GPTQ, AWQ and compressed-tensors store w = scale * (q - zero) per group of inputs. Each is read
(shard/layers/checkpoint_formats.py) into GGUF's form (shard/layers/ggml_quants.py): q small
integers, a float32 scale and low per group of consecutive inputs with low = -zero * scale, so
LinearWeight serves both alike. With fp16 or bf16 scales every product is exact in float32, and
q * scale + low equals scale * (q - zero) bit for bit. FP8 values are no grid of integers: they
are held as stored and dequantized a layer at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shard.layers.ggml_quants import Groups


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """Rows of a checkpoint's integer-quantized weight as (q, scale, low) over permuted inputs.

    Column j of q is the checkpoint's input `input_order[j]` (None: the inputs in their order), so
    each group's inputs are consecutive even where GPTQ's act-order scatters them. q is int8 (4-bit:
    0..15, the int4 form's; 8-bit: -128..127, the int8 form's), half the bytes of int16."""
    kind: str
    q: torch.Tensor  # [rows, columns] int8
    scale: torch.Tensor  # [rows, columns / group] float32
    low: torch.Tensor
    group: int
    bits: int
    input_order: torch.Tensor | None = None  # [columns] int64

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def columns(self) -> int:
        return self.q.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    @property
    def data(self) -> torch.Tensor:
        """What the rows are held in (its device is theirs)."""
        return self.q

    def groups(self) -> Groups:
        """The groups over the permuted inputs (input_order's), q as int16."""
        return Groups(self.q.to(torch.int16), self.scale, self.low, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [rows, columns] with the checkpoint's order of inputs."""
        weight = self.groups().restore()
        if self.input_order is not None:
            ordered = torch.empty_like(weight)
            ordered[:, self.input_order] = weight
            weight = ordered
        return weight.to(dtype)

    def take(self, rows: torch.Tensor) -> "QuantizedRows":
        return QuantizedRows(self.kind, self.q[rows], self.scale[rows], self.low[rows], self.group,
                             self.bits, self.input_order)

    def to(self, device: torch.device) -> "QuantizedRows":
        order = None if self.input_order is None else self.input_order.to(device)
        return QuantizedRows(self.kind, self.q.to(device), self.scale.to(device),
                             self.low.to(device), self.group, self.bits, order)

    @classmethod
    def stacked(cls, parts: list["QuantizedRows"]) -> "QuantizedRows":
        """Parts of one tensor (same kind, groups and input order) as one."""
        first = parts[0]
        if any(p.group != first.group or not same_order(p.input_order, first.input_order)
               for p in parts):
            raise ValueError(f"rows of {first.kind} with different groups stacked as one")
        return QuantizedRows(first.kind, torch.cat([p.q for p in parts]),
                             torch.cat([p.scale for p in parts]),
                             torch.cat([p.low for p in parts]), first.group, first.bits,
                             first.input_order)


@dataclass(frozen=True, slots=True)
class FloatRows:
    """Rows of an FP8 checkpoint's weight: float8 values times a float32 scale per group.

    `bits` is 0: no grid of integers for the int4 or int8 forms, so LinearWeight dequantizes these a
    layer at a time (float8 * scale in float32, exact as the checkpoint's own dequantization)."""
    kind: str
    data: torch.Tensor  # [rows, columns] float8
    scale: torch.Tensor  # [rows, ceil(columns / group)] float32
    group: int
    bits: int = 0
    input_order: None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def columns(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    def groups(self) -> Groups:
        raise ValueError(f"{self.kind} values are no grid of integers")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.repeat_interleave(self.group, dim=1)[:, :self.columns]
        return (self.data.float() * scale).to(dtype)

    def take(self, rows: torch.Tensor) -> "FloatRows":
        return FloatRows(self.kind, self.data[rows], self.scale[rows], self.group)

    def to(self, device: torch.device) -> "FloatRows":
        return FloatRows(self.kind, self.data.to(device), self.scale.to(device), self.group)

    @classmethod
    def stacked(cls, parts: list["FloatRows"]) -> "FloatRows":
        """Parts of one tensor as one (their groups regrouped to the smallest)."""
        group = math.gcd(*(p.group for p in parts))
        return FloatRows(parts[0].kind, torch.cat([p.data for p in parts]),
                         torch.cat([p.scale.repeat_interleave(p.group // group, dim=1)
                                    [:, :-(-p.columns // group)] for p in parts]), group)


def same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two input orders are the same permutation (None: the identity)."""
    if a is None or b is None:
        return a is None and b is None
    return a is b or torch.equal(a, b)


def indexed_rows(kind: str, bits: int, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 group_ids: torch.Tensor) -> QuantizedRows:
    """QuantizedRows of w[o, i] = q[o, i] * scale[o, group_ids[i]] + low[o, group_ids[i]].

    q [rows, columns] integers; scale, low [rows, num_groups] float32; group_ids [columns].
    1. Sort the inputs by group (stably): each group's inputs become one consecutive run.
    2. Hold groups of the largest size that tiles every run (a group of 128 stays 128; a
       rank's share of act-order groups may need less).
    3. Keep the permutation unless it is the identity."""
    order = torch.argsort(group_ids, stable=True)
    sorted_ids = group_ids[order]
    runs = torch.unique_consecutive(sorted_ids, return_counts=True)[1]
    group = math.gcd(*runs.tolist())
    chunk_ids = sorted_ids[::group]  # the checkpoint group of each held group
    is_identity = bool(torch.equal(order, torch.arange(len(order))))
    held = q if is_identity else q[:, order]
    return QuantizedRows(kind, held.to(torch.int8).contiguous(),
                         scale[:, chunk_ids].contiguous(), low[:, chunk_ids].contiguous(), group,
                         bits, None if is_identity else order)


def integer_rows(kind: str, bits: int, q: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group_ids: torch.Tensor) -> QuantizedRows:
    """QuantizedRows of w = scale * (q - zero), q and zero unsigned codes of `bits` bits.

    4-bit q stays 0..15 (the int4 form's) with low = -zero * scale; 8-bit q moves to -128..127
    (the int8 form's) with low = (128 - zero) * scale. scale [rows, num_groups] float32."""
    zero = zero.float()
    if bits == 4:
        return indexed_rows(kind, bits, q, scale, -(zero * scale), group_ids)
    return indexed_rows(kind, bits, q.to(torch.int16) - 128, scale, (128 - zero) * scale,
                        group_ids)
