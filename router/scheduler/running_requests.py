"""The requests the shards hold, by id, and the KV blocks each one holds.

Blocks are freed exactly once, when a request leaves; a computed prompt's full blocks are offered to
the prefix cache.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from router.kv.block_allocator import BlockAllocator
from router.kv.prefix_cache import PrefixCache
from router.kv.sessions import SessionStore
from router.scheduler.active_request import ActiveRequest
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router.running")


class RunningRequests:
    def __init__(self, allocator: BlockAllocator, prefix_cache: PrefixCache | None,
                 metrics: Metrics, sessions: SessionStore | None = None):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.sessions = sessions
        self.metrics = metrics
        self._by_id: dict[int, ActiveRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: int) -> ActiveRequest | None:
        return self._by_id.get(request_id)

    def all(self) -> list[ActiveRequest]:
        return list(self._by_id.values())

    def of(self, request_ids: Iterable[int]) -> list[ActiveRequest]:
        """The running requests among `request_ids` (on failure or when tracing, not per step)."""
        return [self._by_id[i] for i in request_ids if i in self._by_id]

    def start(self, items: list[ActiveRequest]) -> None:
        """`items` go to the shards now, with the blocks the queue allocated them."""
        now = time.monotonic()
        for item in items:
            item.batched_at = now
            item.attempts += 1
            self._by_id[item.id] = item

    def release(self, request_id: int) -> None:
        """The request is over: it leaves, its blocks are freed."""
        item = self.drop(request_id)
        if item is not None:
            item.is_done = True

    def drop(self, request_id: int) -> ActiveRequest | None:
        """Takes a request out and frees its blocks, without ending it: it may run again."""
        item = self._by_id.pop(request_id, None)
        if item is not None and item.allocation is not None:
            self.allocator.free(item.allocation)
        return item

    def remember_prompts(self, items: list[ActiveRequest]) -> None:
        """Computed prompts' full blocks join the prefix cache (they never change afterwards)."""
        cache = self.prefix_cache
        if cache is None:
            return
        for item in items:
            if item.prompt_ids is not None:
                try:
                    cache.insert(item.prompt_ids, item.allocation.block_ids,
                                 adapter_id=item.adapter_id, images=item.prompt_images)
                except Exception:  # the request goes on; only its prompt is not reused
                    log.exception("could not cache the prompt of request %d", item.id)
            if item.cache_len:
                self.metrics.counters.inc("tgi_prefix_cache_hits", item.cache_len)

    def reset_pool(self, num_blocks: int) -> None:
        """The shards restarted with an empty pool of `num_blocks` blocks.

        Every holder of a block was failed or sent back to the queue, and the cached
        prefixes name nothing now.
        """
        self.allocator.pool.reset(num_blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.sessions is not None:  # their tokens stay: their next calls compute them again
            self.sessions.clear_blocks()
        self.update_gauges()
        self.metrics.kv_total_blocks.set(self.allocator.num_usable_blocks)

    def update_gauges(self) -> None:
        self.metrics.kv_free_blocks.set(self.allocator.num_free_blocks)
        if self.prefix_cache is not None:
            self.metrics.kv_prefix_blocks.set(len(self.prefix_cache))
        if self.sessions is not None:
            self.metrics.kv_session_blocks.set(self.sessions.held_blocks)
            self.metrics.sessions.set(len(self.sessions))
