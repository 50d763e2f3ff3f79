"""Reads checkpoint tensors from safetensors files, whole or as this rank's slice, in the model dtype."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from shard.checkpoint_files import checkpoint_files
from shard.distributed import ParallelContext
from shard.layers.checkpoint_formats import read_stored, stored_prefix, stored_shape
from shard.layers.ggml_quants import BlockRows
from shard.layers.ggml_types import BLOCKS_KEY, column_bytes
from shard.layers.precision import activation_dtype
from shard.quant_config import CheckpointQuant

log = logging.getLogger(__name__)


class Weights:
    """An index of tensor name -> file over the checkpoint's safetensors files.

    The files are those its model.safetensors.index.json names, else model.safetensors, else every
    *.safetensors (shard.checkpoint_files: a stray consolidated.safetensors beside the shards is
    never opened)."""

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext, quantize: str | None = None,
                 checkpoint_quant: CheckpointQuant | None = None):
        self.dtype = dtype
        self.quantize = quantize  # linear layers' weight-only form (shard.layers.quantize)
        # how a quantized checkpoint stores its linear weights (config.json's quantization_config)
        self.checkpoint_quant = checkpoint_quant
        # what the hidden states between the weights are held in: the weights' dtype, except bf16
        # on CPUs that only store it, where every matmul computes in float32 anyway
        self.activation_dtype = activation_dtype(dtype, device)
        self.device = device
        self.parallel = parallel
        self._files = {}
        self._name_to_file: dict[str, Path] = {}
        self._stored_as: dict[str, str] = {}  # a name read under another prefix -> its own
        # a native GGUF conversion's tensors kept as blocks: name -> (ggml type, columns)
        self.blocks: dict[str, tuple[str, int]] = {}
        for path in checkpoint_files(Path(model_dir)):
            handle = safe_open(str(path), framework="pt")
            self._files[path] = handle
            for name in handle.keys():
                self._name_to_file[name] = path
            listed = (handle.metadata() or {}).get(BLOCKS_KEY)
            if listed:
                self.blocks.update({name: (kind, int(columns))
                                    for name, (kind, columns) in json.loads(listed).items()})

    def read_prefix_as(self, stored: str, wanted: str) -> None:
        """Tensors stored as `stored` + rest are also read as `wanted` + rest.

        Where a family's checkpoints name its language model otherwise (Qwen2.5-VL's saved by
        transformers 4.52 to 4.57: model.language_model.layers.0... for model.layers.0...)."""
        for name, path in list(self._name_to_file.items()):
            if name.startswith(stored):
                alias = wanted + name[len(stored):]
                self._name_to_file.setdefault(alias, path)
                self._stored_as.setdefault(alias, name)

    def has(self, name: str) -> bool:
        return name in self._name_to_file or self._stored_prefix(name) is not None

    def _stored_prefix(self, name: str) -> str | None:
        """The layer prefix of a linear weight the quantized checkpoint stores in its own form."""
        if self.checkpoint_quant is None:
            return None
        return stored_prefix(self.checkpoint_quant, name, self._name_to_file.__contains__,
                             lambda n: self._slice(n).get_dtype())

    def _slice(self, name: str):
        if name not in self._name_to_file:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._files[self._name_to_file[name]].get_slice(self._stored_as.get(name, name))

    def _place(self, tensor: torch.Tensor, as_stored: bool = False) -> torch.Tensor:
        dtype = tensor.dtype if as_stored else self.dtype
        return _owned(tensor.to(device=self.device, dtype=dtype).contiguous(), tensor)

    @property
    def quantizing(self) -> bool:
        """Whether linear weights are read as stored.

        A GGUF's float32 values hold its 4-bit blocks exactly; rounding them to bf16 first would
        move them off the grid int4 recovers. A native GGUF's blocks are read as BlockRows, a
        quantized checkpoint's linear weights as QuantizedRows or FloatRows."""
        return bool(self.quantize) or bool(self.blocks) or self.checkpoint_quant is not None

    def _read(self, name: str, rows: slice, as_stored: bool,
              columns: tuple[int, int] | None = None):
        """Rows (and `columns`, a range of values) of `name`, placed.

        A block tensor's come as BlockRows where `as_stored`, else dequantized; where the columns
        split its blocks, as their float32 values (the log says so). A quantized checkpoint's
        linear weight comes in its groups (shard/layers/checkpoint_quants.py) where `as_stored`."""
        prefix = self._stored_prefix(name)
        if prefix is not None:
            read = read_stored(self.checkpoint_quant, self._slice, self.has, prefix, rows, columns)
            stored = _owned_fields(read.to(self.device), read)
            if as_stored and stored.bits and stored.group % 32:
                log.info("%s: this rank's inputs split its groups into runs of %d, not 32s; "
                         "dequantized per call", name, stored.group)
            return stored if as_stored else stored.dequantize(self.dtype)
        view = self._slice(name)
        if name not in self.blocks:
            return self._place(view[rows] if columns is None
                               else view[rows, columns[0]:columns[1]], as_stored)
        kind, width = self.blocks[name]
        data = None
        if columns is not None:
            try:
                first, last = column_bytes(kind, *columns)
                data, width = view[rows, first:last], columns[1] - columns[0]
            except ValueError:
                log.info("%s: columns %d..%d split its %s blocks; dequantized", name, *columns,
                         kind)
                values = BlockRows(kind, view[rows].to(self.device).contiguous(), width)
                values = values.dequantize()[:, columns[0]:columns[1]].contiguous()
                return values if as_stored else values.to(self.dtype)
        data = view[rows] if data is None else data
        blocks = BlockRows(kind, _owned(data.to(self.device).contiguous(), data), width)
        return blocks if as_stored else blocks.dequantize(self.dtype)

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, slice(None), False)

    def shape(self, name: str) -> list[int]:
        """The tensor's shape in values (a block tensor's rows and columns, not its bytes)."""
        if name in self.blocks:
            return [self._slice(name).get_shape()[0], self.blocks[name][1]]
        prefix = self._stored_prefix(name)
        if prefix is not None:
            return stored_shape(self.checkpoint_quant, self._slice, prefix)
        return list(self._slice(name).get_shape())

    def get_rows(self, name: str, start: int, stop: int, *, as_stored: bool = False) -> torch.Tensor:
        return self._read(name, slice(start, stop), as_stored)

    def get_sharded(self, name: str, dim: int, *, as_stored: bool = False) -> torch.Tensor:
        """This rank's contiguous 1/world_size of `name` along `dim` (which must divide evenly).

        In the model dtype or, `as_stored`, in the checkpoint's."""
        ctx = self.parallel
        size = self.shape(name)[dim]
        if size % ctx.world_size:
            raise ValueError(f"{name}: dimension {dim} of size {size} does not divide by "
                             f"{ctx.world_size} shards")
        block = size // ctx.world_size
        start, stop = ctx.rank * block, (ctx.rank + 1) * block
        if dim == 0:
            return self._read(name, slice(start, stop), as_stored)
        return self._read(name, slice(None), as_stored, columns=(start, stop))


def _owned(placed: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`placed` in memory of its own where it still lies in the file's mapping (as `read` does).

    A tensor kept as read (a GGUF's embedding blocks, a bf16 weight served as bf16) would hold the
    whole file's mapping, whose every page the load touched: the resident memory would count the
    file beside the weights packed from it."""
    if placed.untyped_storage().data_ptr() == read.untyped_storage().data_ptr():
        return placed.clone()
    return placed


def _owned_fields(placed, read):
    """A quantized checkpoint's rows (a dataclass of tensors) with each tensor `_owned`.

    An FP8 checkpoint's values are kept as read (FloatRows)."""
    changes = {f.name: _owned(getattr(placed, f.name), getattr(read, f.name))
               for f in dataclasses.fields(placed)
               if isinstance(getattr(placed, f.name), torch.Tensor)}
    return dataclasses.replace(placed, **changes)
