"""GGUF's quantized block types: their sizes, and where a row's values lie in a row's bytes.

Without torch: the launcher reads these when it converts a file, and a process that only supervises
the shards need not hold PyTorch (shard/layers/ggml_quants.py computes the blocks' values).
"""
from __future__ import annotations

from dataclasses import dataclass

# the K-quants' superblock of 256 values
QK_K = 256
# the safetensors metadata key of a native GGUF conversion (launcher/gguf.py) that names each block
# tensor's type and row length: {name: [type, columns]}
BLOCKS_KEY = "gguf_blocks"


@dataclass(frozen=True, slots=True)
class BlockType:
    """One ggml type: values and bytes per block, values per (scale, low) group, q's bits."""
    name: str
    block_values: int
    block_bytes: int
    group: int
    bits: int


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 32, 18, 32, 4), BlockType("Q4_1", 32, 20, 32, 4),
    BlockType("Q5_0", 32, 22, 32, 5), BlockType("Q5_1", 32, 24, 32, 5),
    BlockType("Q8_0", 32, 34, 32, 8), BlockType("Q4_K", QK_K, 144, 32, 4),
    BlockType("Q5_K", QK_K, 176, 32, 5), BlockType("Q6_K", QK_K, 210, 16, 6))}
SERVED_TYPES = tuple(BLOCK_TYPES)


def row_bytes(kind: str, columns: int) -> int:
    """Bytes a row of `columns` values takes in `kind`'s blocks."""
    block = BLOCK_TYPES[kind]
    if columns % block.block_values:
        raise ValueError(f"a row of {columns} values is not whole {kind} blocks of "
                         f"{block.block_values}")
    return columns // block.block_values * block.block_bytes


def column_bytes(kind: str, start: int, stop: int) -> tuple[int, int]:
    """The byte range of a row that holds columns [start, stop), which must be whole blocks."""
    block = BLOCK_TYPES[kind]
    if start % block.block_values or stop % block.block_values:
        raise ValueError(f"columns {start}..{stop} split {kind} blocks of {block.block_values}")
    return (start // block.block_values * block.block_bytes,
            stop // block.block_values * block.block_bytes)
