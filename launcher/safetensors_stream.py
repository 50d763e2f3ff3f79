"""Safetensors files written tensor by tensor, in shards laid out as transformers lays them out.

safetensors' own `save_file` takes every tensor at once; a converted model would then sit in memory
whole. The format needs only the shapes up front (an 8-byte little-endian header length, a JSON
header of dtype, shape and byte range per tensor, then the raw bytes in that order), so the header
is written first and each tensor's bytes follow as they are produced.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# transformers' default is 5 GB; smaller shards keep a partial download or copy cheap to redo
MAX_SHARD_BYTES = 2 * 10**9
ITEM_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: "BF16", "F32"

    @property
    def nbytes(self) -> int:
        count = ITEM_SIZES[self.dtype]
        for dim in self.shape:
            count *= dim
        return count


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES
                ) -> list[list[TensorSpec]]:
    """The tensors' split into shards: in order, a new shard whenever the next one would overflow.

    A tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """transformers' names: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors header: length prefix and JSON header, padded to align the data.

    Padded with spaces so that the data starts 8-byte aligned (what safetensors itself writes)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_shard(path: Path, specs: list[TensorSpec], chunks: Iterable[Iterator[memoryview]],
                metadata: dict[str, str] | None = None) -> None:
    """`chunks` yields, per spec and in order, the tensor's bytes piece by piece."""
    with open(path, "wb") as file:
        file.write(header_bytes(specs, metadata))
        for spec, pieces in zip(specs, chunks, strict=True):
            written = sum(file.write(piece) for piece in pieces)
            if written != spec.nbytes:
                raise ValueError(f"{spec.name}: wrote {written} bytes, its shape {spec.shape} "
                                 f"in {spec.dtype} needs {spec.nbytes}")


def write_index(out_dir: Path, shards: list[list[TensorSpec]], names: list[str]) -> None:
    weight_map = {spec.name: name for shard, name in zip(shards, names) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
