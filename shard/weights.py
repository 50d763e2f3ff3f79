"""Reads checkpoint tensors from safetensors files, whole or as this rank's slice, in the model dtype."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from shard.checkpoint_files import checkpoint_files
from shard.distributed import ParallelContext
from shard.layers.precision import activation_dtype


class Weights:
    """An index of tensor name -> file over the checkpoint's safetensors files.

    The files are those its model.safetensors.index.json names, else model.safetensors, else every
    *.safetensors (shard.checkpoint_files: a stray consolidated.safetensors beside the shards is
    never opened)."""

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext, quantize: str | None = None):
        self.dtype = dtype
        self.quantize = quantize  # linear layers' weight-only form (shard.layers.quantize)
        # what the hidden states between the weights are held in: the weights' dtype, except bf16
        # on CPUs that only store it, where every matmul computes in float32 anyway
        self.activation_dtype = activation_dtype(dtype, device)
        self.device = device
        self.parallel = parallel
        self._files = {}
        self._name_to_file: dict[str, Path] = {}
        for path in checkpoint_files(Path(model_dir)):
            handle = safe_open(str(path), framework="pt")
            self._files[path] = handle
            for name in handle.keys():
                self._name_to_file[name] = path

    def has(self, name: str) -> bool:
        return name in self._name_to_file

    def _slice(self, name: str):
        if name not in self._name_to_file:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._files[self._name_to_file[name]].get_slice(name)

    def _place(self, tensor: torch.Tensor, as_stored: bool = False) -> torch.Tensor:
        dtype = tensor.dtype if as_stored else self.dtype
        return tensor.to(device=self.device, dtype=dtype).contiguous()

    @property
    def quantizing(self) -> bool:
        """Whether linear weights are read as stored.

        A GGUF's float32 values hold its 4-bit blocks exactly; rounding them to bf16 first would
        move them off the grid int4 recovers."""
        return bool(self.quantize)

    def get(self, name: str) -> torch.Tensor:
        return self._place(self._slice(name)[:])

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def get_rows(self, name: str, start: int, stop: int, *, as_stored: bool = False) -> torch.Tensor:
        return self._place(self._slice(name)[start:stop], as_stored)

    def get_sharded(self, name: str, dim: int, *, as_stored: bool = False) -> torch.Tensor:
        """This rank's contiguous 1/world_size of `name` along `dim` (which must divide evenly).

        In the model dtype or, `as_stored`, in the checkpoint's."""
        ctx = self.parallel
        view = self._slice(name)
        size = view.get_shape()[dim]
        if size % ctx.world_size:
            raise ValueError(f"{name}: dimension {dim} of size {size} does not divide by "
                             f"{ctx.world_size} shards")
        block = size // ctx.world_size
        start, stop = ctx.rank * block, (ctx.rank + 1) * block
        tensor = view[start:stop] if dim == 0 else view[:, start:stop]
        return self._place(tensor, as_stored)
