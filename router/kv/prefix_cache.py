"""Reuse of computed prompt blocks: full KV blocks keyed by a hash chained to their predecessor.

A block's key covers every token before it, so equal keys mean equal prefixes (the tokens are kept
and compared as well, so a hash collision can never share wrong keys and values). The cache holds one
reference to each block it knows; a block only the cache holds is evicted least-recently-used when
the pool runs short. Pure: no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from router.kv.block_allocator import BlockAllocator


@dataclass(slots=True)
class CachedBlock:
    block_id: int
    tokens: tuple[int, ...]
    parent_key: int | None


class PrefixCache:
    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self._blocks: OrderedDict[int, CachedBlock] = OrderedDict()  # key -> block, LRU first
        allocator.reclaim = self.evict

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, token_ids: list[int]):
        """(key, parent key, tokens) of each full block of `token_ids`."""
        parent = None
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            key = hash((parent, tokens))
            yield key, parent, tokens
            parent = key

    def clear(self) -> None:
        """Forgets every block without letting go of them: for a pool about to be reset."""
        self._blocks.clear()

    def match(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of full blocks; the caller gets a reference to each."""
        found = []
        for key, _, tokens in self._keys(token_ids):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            self._blocks.move_to_end(key)
            found.append(block.block_id)
        self.allocator.incref(found)
        return found

    def insert(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Remembers the full blocks of a computed prompt (block_ids[i] holds its i-th block)."""
        for (key, parent, tokens), block_id in zip(self._keys(token_ids), block_ids):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = CachedBlock(block_id, tokens, parent)
            self.allocator.incref([block_id])

    def evict(self, needed: int) -> int:
        """Frees up to `needed` blocks that only the cache holds, least recently used first."""
        freed = 0
        for key in list(self._blocks):
            if freed >= needed:
                break
            block = self._blocks[key]
            if self.allocator.ref_count(block.block_id) == 1:
                del self._blocks[key]
                self.allocator.decref([block.block_id])
                freed += 1
        return freed
