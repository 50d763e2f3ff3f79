"""LoRA updates on a linear layer, each row of a batch with its own adapter (or none).

Every adapter loaded on a model has a slot; a linear layer an adapter changes holds, per checkpoint
module it computes (q_proj, k_proj and v_proj of a fused qkv projection), the adapters' lora_A and
lora_B stacked by slot (`LoraPart`). A forward's rows each name a slot (`LoraRows`, -1: the base
model), and the layer adds x A_s^T B_s^T to each row's output: a batched gather of the row's own A
and B, in the C kernel (shard/kernels/lora.c) on CPUs, as masked matmuls over the batch's adapters
elsewhere. The base weights are never changed and the batch is never split.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.distributed import ParallelContext
from shard.kernels import lora as lora_kernel


@dataclass(slots=True)
class CheckpointPart:
    """A checkpoint module whose output rows a column-parallel layer computes.

    `name` (such as model.layers.0.self_attn.q_proj) and the full sizes of the projections its
    tensor stacks (one, or several for a fused tensor such as Phi-3's qkv_proj)."""

    name: str
    sizes: list[int]


@dataclass(slots=True)
class LoraSource:
    """What a linear layer tells adapters about itself.

    The checkpoint modules it computes, how its weight is split across ranks, and the dtype its
    weights are held in."""

    parts: list[CheckpointPart]
    in_features: int  # the full input width (a row-parallel rank holds 1/world_size of it)
    row_parallel: bool
    parallel: ParallelContext
    dtype: torch.dtype
    device: torch.device
    row_order: torch.Tensor | None = None  # a column-parallel layer's own order of its rows

    def local_rows(self, part: CheckpointPart, b: torch.Tensor) -> torch.Tensor:
        """lora_B [sum(sizes), r] -> the rows this rank's part of the output holds, in its order."""
        if self.row_parallel:
            return b
        ctx, rows, start = self.parallel, [], 0
        for size in part.sizes:
            block = size // ctx.world_size
            rows.append(b[start + ctx.rank * block: start + (ctx.rank + 1) * block])
            start += size
        b = torch.cat(rows)
        return b if self.row_order is None else b[self.row_order.to(b.device)]

    def local_columns(self, a: torch.Tensor) -> torch.Tensor:
        """lora_A [r, in_features] -> the inputs this rank reads."""
        if not self.row_parallel:
            return a
        block = a.shape[1] // self.parallel.world_size
        return a[:, self.parallel.rank * block: (self.parallel.rank + 1) * block]

    def full_rows(self, part: CheckpointPart) -> int:
        return sum(part.sizes)


@dataclass(slots=True)
class LoraRows:
    """The adapter slot of each row of one forward (-1: the base model).

    With what the PyTorch path derives from them once per forward."""

    slots: torch.Tensor  # int64 [rows]
    _present: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def present(self) -> torch.Tensor:
        """The slots some row uses, sorted (on the rows' device)."""
        if self._present is None:
            unique = torch.unique(self.slots)
            self._present = unique[unique >= 0]
        return self._present

    def mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """The [rows, present * rank] mask of each row's own adapter among the stacked present ones.

        1 where a column of the stacked present adapters belongs to the row's own adapter, else 0.
        """
        key = (rank, dtype)
        if key not in self._masks:
            owns = self.slots.unsqueeze(1) == self.present().unsqueeze(0)  # [rows, present]
            self._masks[key] = owns.to(dtype).repeat_interleave(rank, dim=1)
        return self._masks[key]


@dataclass(slots=True)
class LoraPart:
    """The adapters' update of one checkpoint module, stacked by slot.

    `a` [slots, rank, in], `bt` [slots, rank, width] (lora_B transposed, times the adapter's
    scaling), `ranks` [slots] (0 where the slot's adapter does not change this module). Rows past
    an adapter's own rank are zeros. It writes columns offset .. offset + width of the layer's
    output."""

    name: str
    offset: int
    width: int
    a: torch.Tensor
    bt: torch.Tensor
    ranks: torch.Tensor

    def resized(self, slots: int, rank: int) -> "LoraPart":
        """This part with room for `slots` slots of up to `rank` (its contents kept)."""
        old_slots, old_rank = self.a.shape[0], self.a.shape[1]
        a = self.a.new_zeros(slots, rank, self.a.shape[2])
        bt = self.bt.new_zeros(slots, rank, self.width)
        ranks = self.ranks.new_zeros(slots)
        keep_slots, keep_rank = min(slots, old_slots), min(rank, old_rank)
        a[:keep_slots, :keep_rank] = self.a[:keep_slots, :keep_rank]
        bt[:keep_slots, :keep_rank] = self.bt[:keep_slots, :keep_rank]
        ranks[:keep_slots] = self.ranks[:keep_slots]
        return LoraPart(self.name, self.offset, self.width, a, bt, ranks)


class LoraTarget:
    """The LoRA parts of one linear layer and the rows of the forward running now.

    The rows are set by the model's AdapterSet."""

    def __init__(self, parts: list[LoraPart], rows_of):
        self.parts = parts
        self._rows_of = rows_of  # () -> LoraRows | None: the current forward's rows

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The base layer's output with each row's adapter update added.

        out is the base layer's output for x, [rows, out_features]; out itself comes back where no
        row has an adapter."""
        rows = self._rows_of()
        if rows is None:
            return out
        if _kernel_applies(x, out):
            for part in self.parts:
                lora_kernel.add(x, out, rows.slots, part.a, part.bt, part.ranks, part.offset,
                                part.width)
            return out
        present = rows.present()
        if present.numel() == 0:
            return out
        for part in self.parts:
            rank = part.a.shape[1]
            a = part.a.index_select(0, present).reshape(-1, part.a.shape[2]).to(x.dtype)
            bt = part.bt.index_select(0, present).reshape(-1, part.width).to(x.dtype)
            shrunk = (x @ a.T) * rows.mask(rank, x.dtype)
            out[:, part.offset: part.offset + part.width] += (shrunk @ bt).to(out.dtype)
        return out


def _kernel_applies(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the C kernel takes this update: bf16 rows on a CPU where it built."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
            and out.is_contiguous() and lora_kernel.load_library() is not None)
