"""The LoRA adapters loaded on one model, a slot per adapter.

Each adapter's updates are placed in the linear layers it changes (this rank's slices of them),
and the set holds the slot of each row of the forward running now. Reading an adapter's files
(`read`) touches nothing of the set, so it runs off the engine thread; placing it (`install`)
and unloading run on it.

The slots are dense, 0 .. n - 1: an unload moves the last adapter into the slot it frees. The
stacks' room doubles as adapters come, so a load copies the others only when it crosses a power
of two, and shrinks once the stacks hold four times what the adapters need, so that unloading
gives the memory back.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from shard.adapters.peft_files import (MAX_CONFIG_BYTES, AdapterError, ModuleShape, PeftAdapter,
                                       largest_weights_bytes, read_adapter)
from shard.layers.lora import LoraPart, LoraRows, LoraTarget

# the largest rank served; the stacks of every layer an adapter changes are as wide as the largest
# rank loaded, so one adapter of a huge rank would slow every request that uses any adapter
MAX_RANK = 64


class AdapterExists(ValueError):
    pass


@dataclass(slots=True)
class LoadedAdapter:
    name: str
    slot: int
    rank: int
    alpha: float
    scaling: float
    target_modules: list[str]
    base_model: str
    width: int  # its largest module rank (rank_pattern may give a module more than `rank`)


@dataclass(slots=True)
class _Placement:
    linear: nn.Module
    part: int  # index into linear.lora_source.parts
    a: torch.Tensor  # [rank, this rank's inputs], as read
    b: torch.Tensor  # [this rank's output rows of the part, rank], as read
    scaling: float


class AdapterSet:
    def __init__(self, model: nn.Module):
        # checkpoint module name -> (the linear layer computing it, which of its parts)
        self._modules: dict[str, tuple[nn.Module, int]] = {}
        for module in model.modules():
            source = getattr(module, "lora_source", None)
            if source is not None:
                for index, part in enumerate(source.parts):
                    self._modules[part.name] = (module, index)
        # what an adapter's tensors are checked against: each module's full widths
        self._shapes = {name: ModuleShape(linear.lora_source.in_features,
                                          linear.lora_source.full_rows(linear.lora_source.parts[i]))
                        for name, (linear, i) in self._modules.items()}
        self.adapters: dict[str, LoadedAdapter] = {}
        self.version = 0  # bumped on every load and unload: the stacks may have moved
        self.rows: LoraRows | None = None  # the forward running now
        self._slots = 0  # the stacks' room
        self._rank = 0
        self._targets: list[nn.Module] = []  # the linear layers holding a LoraTarget

    def slot_of(self, name: str) -> int:
        """KeyError for a name not loaded."""
        return self.adapters[name].slot

    def largest_files_bytes(self) -> int:
        """The most bytes an adapter's config and weights can hold and still load here (0: none)."""
        if not self._modules:
            return 0
        return MAX_CONFIG_BYTES + largest_weights_bytes(self._shapes, MAX_RANK)

    def read(self, path: str | Path) -> PeftAdapter:
        """An adapter's files, read and checked against this model; any thread.

        AdapterError when it cannot serve here."""
        if not self._modules:
            raise AdapterError("this model's layers take no LoRA adapters")
        return read_adapter(path, self._shapes, max_rank=MAX_RANK)

    def install(self, name: str, adapter: PeftAdapter) -> LoadedAdapter:
        """Places a read adapter in the next slot; on the engine thread.

        AdapterExists (nothing changed) for a name in use."""
        if name in self.adapters:
            raise AdapterExists(f"an adapter named {name!r} is already loaded")
        placements = [self._placement(module, update)
                      for module, update in sorted(adapter.modules.items())]
        rank = max(p.a.shape[0] for p in placements)
        slot = len(self.adapters)
        try:
            if slot >= self._slots or rank > self._rank:
                self._resize(max(self._slots, _room(slot + 1)), max(self._rank, rank))
            for placement in placements:
                part = self._target(placement.linear).parts[placement.part]
                r = placement.a.shape[0]
                # straight into the stacks, B's float32 product rounded once to their dtype:
                # this runs between steps, and contiguous float copies first took a third longer
                part.a[slot, :r].copy_(placement.a)
                torch.mul(placement.b.T.to(part.bt.device, torch.float32), placement.scaling,
                          out=part.bt[slot, :r])
                part.ranks[slot] = r
        except BaseException:  # out of memory half-way: the slot must not keep what it got
            self._clear(slot)
            raise
        finally:  # the stacks may have moved, even when the load failed
            self.version += 1
        loaded = LoadedAdapter(name, slot, adapter.rank, adapter.alpha, adapter.scaling,
                               adapter.target_modules, adapter.base_model, rank)
        self.adapters[name] = loaded
        return loaded

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """read, then install (on one thread)."""
        return self.install(name, self.read(path))

    def unload(self, name: str) -> dict[int, int]:
        """Frees `name`'s slot; the slot that moved into it ({old: new}, or none).

        KeyError for a name not loaded. Rows that name the moved slot must name the new one."""
        gone = self.adapters.pop(name)
        last, moved = len(self.adapters), {}
        if gone.slot != last:
            mover = next(a for a in self.adapters.values() if a.slot == last)
            self._copy_slot(last, gone.slot)
            self.adapters[mover.name] = replace(mover, slot=gone.slot)
            moved[last] = gone.slot
        self._clear(last)
        # a layer no adapter changes now goes back to costing nothing
        for linear in [t for t in self._targets if not any(p.ranks.any() for p in t.lora.parts)]:
            linear.detach_lora()
            self._targets.remove(linear)
        if not self.adapters:
            self._slots, self._rank = 0, 0
        else:
            needed = max(a.width for a in self.adapters.values())
            if 4 * len(self.adapters) * needed <= self._slots * self._rank:
                self._resize(_room(len(self.adapters)), needed)
        self.version += 1
        return moved

    def tensor_bytes(self) -> int:
        """What the adapters' stacks hold, in bytes."""
        return sum(t.nbytes for linear in self._targets for part in linear.lora.parts
                   for t in (part.a, part.bt, part.ranks))

    @contextmanager
    def applied(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Row i of the forward run inside gets the update of adapter slot slots[i] (-1: none)."""
        if slots is None or not self.adapters:
            yield
            return
        self.rows = LoraRows(slots)
        try:
            yield
        finally:
            self.rows = None

    def _clear(self, slot: int) -> None:
        for linear in self._targets:
            for part in linear.lora.parts:
                if slot < part.ranks.shape[0]:
                    part.a[slot].zero_()
                    part.bt[slot].zero_()
                    part.ranks[slot] = 0

    def _current_rows(self) -> LoraRows | None:
        return self.rows

    def _placement(self, module: str, update) -> _Placement:
        """This rank's slices of a module's update (read checked its widths against the model)."""
        linear, index = self._modules[module]
        source = linear.lora_source
        return _Placement(linear, index, source.local_columns(update.a),
                          source.local_rows(source.parts[index], update.b), update.scaling)

    def _target(self, linear: nn.Module) -> LoraTarget:
        """The layer's LoraTarget, made (empty, as wide as the stacks) the first time."""
        if linear.lora is None:
            source, parts, offset = linear.lora_source, [], 0
            for part in source.parts:
                width = part_width(source, part)
                parts.append(LoraPart(
                    part.name, offset, width,
                    torch.zeros(self._slots, self._rank, local_inputs(source), dtype=source.dtype,
                                device=source.device),
                    torch.zeros(self._slots, self._rank, width, dtype=source.dtype,
                                device=source.device),
                    torch.zeros(self._slots, dtype=torch.int64, device=source.device)))
                offset += width
            linear.attach_lora(LoraTarget(parts, self._current_rows))
            self._targets.append(linear)
        return linear.lora

    def _resize(self, slots: int, rank: int) -> None:
        """The stacks with room for `slots` adapters of up to `rank`, the first slots kept."""
        if (slots, rank) == (self._slots, self._rank):
            return
        for linear in self._targets:
            linear.lora.parts = [part.resized(slots, rank) for part in linear.lora.parts]
        self._slots, self._rank = slots, rank

    def _copy_slot(self, source: int, target: int) -> None:
        for linear in self._targets:
            for part in linear.lora.parts:
                part.a[target] = part.a[source]
                part.bt[target] = part.bt[source]
                part.ranks[target] = part.ranks[source]


def _room(count: int) -> int:
    """The stacks' room for `count` adapters: the power of two at or above it."""
    return 1 << max(0, count - 1).bit_length()


def part_width(source, part) -> int:
    """The output rows of `part` this rank computes."""
    return sum(part.sizes) if source.row_parallel else sum(part.sizes) // source.parallel.world_size


def local_inputs(source) -> int:
    return (source.in_features // source.parallel.world_size if source.row_parallel
            else source.in_features)
