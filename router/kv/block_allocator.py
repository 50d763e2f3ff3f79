"""Paged-KV block accounting: the pool of blocks and their holders, and the allocator over it.

Block 0 is never handed out: the shards pad block tables with it. Blocks are reference-counted so that
a prefix, a beam or a fork can share them; a block returns to the free list when its last holder lets go.
The pool is made first, so that what holds blocks besides requests (the prefix cache, sessions) can
be made over it and then given to the allocator as its reclaimers.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# frees up to the given number of blocks that only it holds; returns how many it freed
Reclaimer = Callable[[int], int]


@dataclass(slots=True)
class BlockAllocation:
    block_ids: list[int]
    num_tokens: int  # tokens reserved in these blocks
    is_freed: bool = False


class BlockPool:
    """The KV pool's blocks: which are free, and how many holders each used block has."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Every block free, in a pool of `num_blocks`.

        For shards restarted with empty caches: allocations made before must not be freed
        afterwards.
        """
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # pop() from the end hands out low ids first, which keeps tests readable
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take(self, count: int) -> list[int] | None:
        """`count` free blocks, one holder each; None when fewer are free."""
        if count > len(self._free):
            return None
        block_ids = [self._free.pop() for _ in range(max(count, 0))]
        for block in block_ids:
            self._refs[block] = 1
        return block_ids

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def incref(self, block_ids: list[int]) -> None:
        for block in block_ids:
            self._refs[block] += 1

    def decref(self, block_ids: list[int]) -> None:
        for block in block_ids:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed more often than held"
            if self._refs[block] == 0:
                self._free.append(block)


class BlockAllocator:
    """Requests' allocations from the pool; when it runs short, `reclaimers` are asked in order."""

    def __init__(self, pool: BlockPool, reclaimers: Sequence[Reclaimer] = ()):
        self.pool = pool
        # the router's order: prompts only the prefix cache holds, then idle sessions' blocks
        self.reclaimers = tuple(reclaimers)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.pool.blocks_needed(num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_free_blocks

    def allocate(self, num_tokens: int, *, shared: list[int] = ()) -> BlockAllocation | None:
        """Blocks for `num_tokens` tokens, or None when the pool cannot hold them now.

        `shared` are blocks the caller already holds a reference to (a cached prefix); they come
        first and only the rest is taken from the free list.
        """
        count = self.blocks_needed(max(num_tokens, 1)) - len(shared)
        short = count - self.pool.num_free_blocks
        for reclaim in self.reclaimers:
            if short <= 0:
                break
            short -= reclaim(short)
        block_ids = self.pool.take(count)
        if block_ids is None:
            return None
        return BlockAllocation(list(shared) + block_ids, num_tokens)

    def share(self, allocation: BlockAllocation) -> BlockAllocation:
        """A second holder of the same blocks (for forks and beams)."""
        self.pool.incref(allocation.block_ids)
        return BlockAllocation(list(allocation.block_ids), allocation.num_tokens)

    def free(self, allocation: BlockAllocation) -> None:
        """Lets go of an allocation; freeing one twice is harmless."""
        if allocation.is_freed:
            return
        allocation.is_freed = True
        self.pool.decref(allocation.block_ids)
