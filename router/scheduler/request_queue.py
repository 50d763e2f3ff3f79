"""Waiting requests and the choice of the next prefill batch under token budgets (pure, no I/O).

First in, first served: the scan stops at the first request that does not fit, so a long prompt at the
head is never overtaken forever by shorter ones behind it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from router.kv.block_allocator import BlockAllocation, BlockAllocator
from router.kv.prefix_cache import PrefixCache, outside_images
from router.schemas import PromptImage


class HeldPrefix(Protocol):
    """Blocks that hold the keys and values of a prompt's first `computed` tokens.

    Read when the entry is planned (a request_id session's: router.kv.sessions; it may have let
    go of them).
    """

    blocks: list[int]
    computed: int


@dataclass(slots=True)
class QueueEntry:
    """What the queue needs of a request to plan batches (router.scheduler.active_request extends it)."""

    id: int
    input_length: int
    max_new_tokens: int
    queued_at: float = field(default_factory=time.monotonic)
    allocation: BlockAllocation | None = None
    prompt_ids: list[int] | None = None  # offered to the prefix cache (None: never cached)
    adapter_id: str | None = None  # its LoRA adapter: it shares cached prefixes of that one only
    # its images over their tokens: cached prefixes with the same images only, never split
    prompt_images: list[PromptImage] = field(default_factory=list)
    cache_len: int = 0  # prompt tokens whose keys and values come from the prefix cache
    held_prefix: HeldPrefix | None = None  # where its prompt's start is, before the prefix cache
    attempts: int = 0  # times it was sent to the shards (a shard failure may send it back here)
    # beam search: rows that each may hold a whole sequence, and the tokens added to each so that
    # every row rounds up to whole blocks alone (a block size)
    kv_rows: int = 1
    kv_row_slack: int = 0

    @property
    def kv_tokens(self) -> int:
        # the last generated token is never fed back, so its keys and values are never stored
        tokens = self.input_length + self.max_new_tokens - 1
        return tokens if self.kv_rows == 1 else self.kv_rows * (tokens + self.kv_row_slack)


E = TypeVar("E", bound=QueueEntry)


@dataclass(slots=True)
class BatchPlan(Generic[E]):
    batch_id: int
    entries: list[E]
    prefill_tokens: int
    max_tokens: int
    chunk_len: int | None = None  # set when the plan's one entry is prefilled in chunks


class RequestQueue(Generic[E]):
    def __init__(self, allocator: BlockAllocator, prefix_cache: PrefixCache | None = None, *,
                 chunking: bool = False):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.chunking = chunking
        self._entries: deque[E] = deque()
        self._next_batch_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: E) -> None:
        self._entries.append(entry)

    def entries(self) -> list[E]:
        return list(self._entries)

    def _cached_prefix(self, entry: E) -> tuple[list[int], int]:
        """(blocks holding the start of the entry's prompt, tokens they hold).

        A reference to each block is taken for the caller; at least one prompt token is left
        to compute (its logits choose the first new token).
        """
        held = entry.held_prefix
        if held is not None and held.blocks:
            self.allocator.pool.incref(held.blocks)
            return list(held.blocks), held.computed
        if self.prefix_cache is None or entry.prompt_ids is None:
            return [], 0
        shared = self.prefix_cache.match(entry.prompt_ids, adapter_id=entry.adapter_id,
                                         images=entry.prompt_images)
        size = self.allocator.block_size
        keep = len(shared)
        while keep and keep * size >= entry.input_length:
            keep -= 1
        keep = outside_images(keep * size, entry.prompt_images) // size
        self.allocator.pool.decref(shared[keep:])
        return shared[:keep], keep * size

    def remove(self, entry: E) -> bool:
        """Takes out a waiting entry (its client went away); False if it already left the queue."""
        try:
            self._entries.remove(entry)
        except ValueError:
            return False
        return True

    def next_batch(self, *, min_size: int | None, max_size: int | None, prefill_token_budget: int,
                   token_budget: int, whole_only: bool = False) -> BatchPlan[E] | None:
        """The longest FIFO run of entries that fits both budgets and the KV pool, or None.

        Each chosen entry gets a block allocation for its prompt and all its new tokens. If fewer
        than `min_size` fit, nothing is taken and every allocation made here is returned.
        whole_only: no prompt over the prefill budget (while another is computed in chunks).
        """
        if not self._entries or prefill_token_budget <= 0 or token_budget <= 0 or max_size == 0:
            return None
        if min_size is not None and len(self._entries) < min_size:
            return None
        chosen: list[E] = []
        try:
            return self._plan(chosen, min_size=min_size, max_size=max_size,
                              prefill_token_budget=prefill_token_budget, token_budget=token_budget,
                              whole_only=whole_only)
        except Exception:
            self.put_back(chosen)  # neither queued nor running, they would wait for ever
            raise

    def _plan(self, chosen: list[E], *, min_size: int | None, max_size: int | None,
              prefill_token_budget: int, token_budget: int, whole_only: bool
              ) -> BatchPlan[E] | None:
        prefill_tokens = 0
        max_tokens = 0
        chunk_len = None
        while self._entries:
            entry = self._entries[0]
            if max_tokens + entry.kv_tokens > token_budget:
                break
            shared, cached = self._cached_prefix(entry)
            uncached = entry.input_length - cached
            # a prompt over the whole budget goes alone: in chunks when it can, else at once
            alone = not chosen and uncached > prefill_token_budget
            if alone and whole_only:
                self.allocator.pool.decref(shared)
                break
            allocation = None
            if prefill_tokens + uncached <= prefill_token_budget or alone:
                allocation = self.allocator.allocate(entry.kv_tokens, shared=shared)
            if allocation is None:
                self.allocator.pool.decref(shared)
                break
            entry.allocation, entry.cache_len = allocation, cached
            chosen.append(self._entries.popleft())
            prefill_tokens += uncached
            max_tokens += entry.kv_tokens
            if alone:
                if self.chunking:
                    chunk_len = prefill_token_budget
                break
            if max_size is not None and len(chosen) >= max_size:
                break
        if not chosen or (min_size is not None and len(chosen) < min_size):
            self.put_back(chosen)
            return None
        return BatchPlan(self.new_batch_id(), chosen, prefill_tokens, max_tokens, chunk_len)

    def put_back(self, chosen: list[E]) -> None:
        """Entries taken but never computed go back first, in their order; their blocks are freed.

        A plan not made, or a step the shards lost.
        """
        for entry in reversed(chosen):
            if entry.allocation is not None:
                self.allocator.free(entry.allocation)
            entry.allocation, entry.cache_len = None, 0
            self._entries.appendleft(entry)

    def new_batch_id(self) -> int:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        return batch_id
