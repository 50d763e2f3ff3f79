"""One model's KV accounting, made in dependency order: pool, prefix cache and sessions, allocator.

The prefix cache and the sessions hold blocks of the pool besides the requests; the allocator is
given them as its reclaimers, in the order the pool is reclaimed when it runs short: prompts only
the prefix cache holds first, then the blocks of idle sessions (least recently used first).
"""
from __future__ import annotations

from dataclasses import dataclass

from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.prefix_cache import PrefixCache
from router.kv.sessions import SessionLimits, SessionStore


@dataclass(frozen=True, slots=True)
class KvAccounting:
    """The pool's blocks, who holds them besides requests, and the allocator requests go to."""

    pool: BlockPool
    allocator: BlockAllocator
    prefix_cache: PrefixCache | None
    sessions: SessionStore


def kv_accounting(num_blocks: int, block_size: int, *, prefix_caching: bool,
                  session_limits: SessionLimits = SessionLimits()) -> KvAccounting:
    """A pool of `num_blocks` blocks, its prefix cache (when `prefix_caching`), its sessions."""
    pool = BlockPool(num_blocks, block_size)
    prefix_cache = PrefixCache(pool) if prefix_caching else None
    sessions = SessionStore(pool, session_limits)
    reclaimers = [prefix_cache.evict] if prefix_cache is not None else []
    allocator = BlockAllocator(pool, reclaimers + [sessions.release_blocks])
    return KvAccounting(pool, allocator, prefix_cache, sessions)
