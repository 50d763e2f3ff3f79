"""The (q, scale, low) groups a GGUF's quantized blocks stand for, read from the blocks as stored.

Every type served natively is a grid per group of inputs: w = q * scale + low (a float32 product
rounded, then the sum), q small integers, scale and low float32. Each type's groups are computed
from its blocks with the operations the `gguf` package dequantizes with, so the weights equal its
dequantization bit for bit (tests/unit/shard/test_ggml_quants.py, on the real files' blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.layers.ggml_types import BLOCK_TYPES, QK_K, row_bytes


@dataclass(frozen=True, slots=True)
class Groups:
    """A weight [rows, columns] as q [rows, columns] int16, scale and low [rows, columns / group]."""
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    group: int

    def restore(self) -> torch.Tensor:
        """The float32 weight: q * scale + low, the product rounded, then the sum."""
        rows, columns = self.q.shape
        grouped = self.q.reshape(rows, columns // self.group, self.group).float()
        return (grouped * self.scale[..., None] + self.low[..., None]).reshape(rows, columns)

    def regrouped(self, group: int) -> "Groups":
        """The same weight with (scale, low) repeated over smaller groups of `group` values."""
        if group == self.group:
            return self
        times = self.group // group
        return Groups(self.q, self.scale.repeat_interleave(times, dim=1),
                      self.low.repeat_interleave(times, dim=1), group)


@dataclass(frozen=True, slots=True)
class BlockRows:
    """Rows of a GGUF tensor as stored: data [rows, row bytes] of one type's blocks."""
    kind: str
    data: torch.Tensor
    columns: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    @property
    def bits(self) -> int:
        """Bits of q: 4 for the types the int4 form holds, more for the int8 form's."""
        return BLOCK_TYPES[self.kind].bits

    def groups(self) -> Groups:
        return groups_of(self.kind, self.data, self.columns)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.groups().restore().to(dtype)

    def take(self, rows: torch.Tensor) -> "BlockRows":
        """These rows (an index tensor) of the tensor."""
        return BlockRows(self.kind, self.data[rows], self.columns)

    @classmethod
    def stacked(cls, parts: list["BlockRows"]) -> "BlockRows":
        """Parts of one tensor as one."""
        return BlockRows(parts[0].kind, torch.cat([p.data for p in parts]), parts[0].columns)


@dataclass(frozen=True, slots=True)
class BlockStack:
    """Block tensors stacked by rows: a fused projection's parts (q, k, v may differ in type).

    A part is any quantized rows with BlockRows' interface (kind, rows, columns, bits, groups,
    dequantize, take, stacked, data): a GGUF's blocks, or a quantized checkpoint's
    (shard/layers/checkpoint_quants.py, whose groups may be over permuted inputs)."""
    parts: tuple[BlockRows, ...]

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def columns(self) -> int:
        return self.parts[0].columns

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(part.kind for part in self.parts))

    def groups(self, group: int | None = None) -> Groups:
        """The parts' groups stacked, each regrouped to `group` (the smallest of theirs: None)."""
        groups = [part.groups() for part in self.parts]
        group = group or min(g.group for g in groups)
        groups = [g.regrouped(group) for g in groups]
        return Groups(torch.cat([g.q for g in groups]), torch.cat([g.scale for g in groups]),
                      torch.cat([g.low for g in groups]), group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])

    def take(self, rows: torch.Tensor) -> "BlockStack":
        """These rows of a stack of one type (a model's own order of its fused rows)."""
        if len(self.parts) != 1:
            if len(self.kinds) != 1:
                raise ValueError(f"rows of {' and '.join(self.kinds)} blocks reordered as one")
            whole = type(self.parts[0]).stacked(list(self.parts))
            return BlockStack((whole.take(rows),))
        return BlockStack((self.parts[0].take(rows),))

    def padded(self, rows: int) -> "BlockStack":
        """The stack as one part with rows of zero blocks (zero weights) added up to `rows`.

        An embedding's rank slice: one tensor, which every lookup indexes without joining parts."""
        last = self.parts[-1]
        zeros = last.data.new_zeros(rows - self.rows, last.data.shape[1])
        return BlockStack((BlockRows.stacked([*self.parts, BlockRows(last.kind, zeros,
                                                                      last.columns)]),))


def join_rows(parts: list) -> "torch.Tensor | BlockStack":
    """Row-stacked tensors: float tensors concatenated, block tensors as one BlockStack.

    Where both come together, the blocks are dequantized to float32 and all concatenated. Block
    tensors are any quantized rows (BlockStack's parts), a GGUF's or a quantized checkpoint's."""
    blocks = [p for p in parts if not isinstance(p, torch.Tensor)]
    if not blocks:
        return torch.cat(parts)
    if len(blocks) == len(parts):
        return BlockStack(tuple(r for p in parts
                                for r in (p.parts if isinstance(p, BlockStack) else (p,))))
    return torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize()
                      for p in parts])


def half(data: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block, as float32 [blocks, 1]."""
    return data[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [blocks, chunks * width] -> values [blocks, chunks * 2 * width], in ggml's order.

    Each chunk's low halves, then its high halves."""
    blocks = qs.shape[0]
    chunks = qs.reshape(blocks, -1, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return ((chunks >> shifts) & 15).reshape(blocks, -1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """The 32 bits of a little-endian uint32 per block -> [blocks, 32] values 0 or 1."""
    shifts = torch.arange(count, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], -1)


def scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums -> two [blocks, 8] uint8."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 63, (m_d & 15) | ((d >> 2) & 48)], dim=1)
    mins = torch.cat([m & 63, (m_d >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mins


def _blocks(kind: str, data: torch.Tensor, columns: int) -> torch.Tensor:
    block = BLOCK_TYPES[kind]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(kind, columns):
        raise ValueError(f"{kind} rows of {columns} values are {row_bytes(kind, columns)} bytes "
                         f"each, not {tuple(data.shape)} {data.dtype}")
    return data.reshape(-1, block.block_bytes)


def groups_of(kind: str, data: torch.Tensor, columns: int) -> Groups:
    """The groups rows of `kind`'s blocks stand for (data [rows, row bytes] uint8)."""
    rows = data.shape[0]
    blocks = _blocks(kind, data, columns)
    q, scale, low = _GROUPS[kind](blocks)
    group = BLOCK_TYPES[kind].group
    return Groups(q.to(torch.int16).reshape(rows, columns), scale.reshape(rows, -1),
                  low.reshape(rows, -1), group)


def _q4_0(b):
    d = half(b, 0)
    return _nibbles(b[:, 2:18], 16), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16), half(b, 0), half(b, 2)


def _q5(b, qh_at: int):
    qh = b[:, qh_at:qh_at + 4]
    return _nibbles(b[:, qh_at + 4:qh_at + 20], 16) | (_high_bits(qh, 8) << 4)


def _q5_0(b):
    d = half(b, 0)
    return _q5(b, 2), d, -16 * d


def _q5_1(b):
    return _q5(b, 4), half(b, 0), half(b, 2)


def _q8_0(b):
    d = half(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8), d, torch.zeros_like(d)


def _k_factors(b):
    """Q4_K's and Q5_K's scale (d * sc) and low (-(dmin * m)) per sub-block of 32: [blocks, 8]."""
    sc, mins = scale_min(b[:, 4:16])
    return half(b, 0) * sc.float(), -(half(b, 2) * mins.float())


def _q4_k(b):
    scale, low = _k_factors(b)
    return _nibbles(b[:, 16:144], 32), scale, low


def _q5_k(b):
    scale, low = _k_factors(b)
    high = _high_bits(b[:, 16:48], 8).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, QK_K)
    return _nibbles(b[:, 48:176], 32) | (high << 4), scale, low


def _q6_k(b):
    blocks = b.shape[0]
    low_bits = _nibbles(b[:, 0:128], 64)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high_bits = ((b[:, 128:192].reshape(blocks, 2, 1, 32) >> shifts) & 3).reshape(blocks, -1)
    q = (low_bits | (high_bits << 4)).to(torch.int16) - 32
    scale = half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return q, scale, torch.zeros_like(scale)


_GROUPS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
