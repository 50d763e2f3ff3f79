"""request_id sessions: the blocks they hold are reference-counted like the prefix cache's, bounded
by count, share of the pool and TTL, and a session without blocks keeps its tokens."""
import pytest

from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.sessions import SessionBusy, SessionLimits, SessionStore
from router.scheduler.request_queue import QueueEntry, RequestQueue


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _store(num_blocks=41, *, reclaims=False, **limits):
    """(allocator, store, clock); with `reclaims`, the store is the allocator's reclaimer."""
    pool = BlockPool(num_blocks, 4)  # 40 usable blocks of 4 tokens
    clock = Clock()
    store = SessionStore(pool, SessionLimits(**limits), clock=clock)
    return BlockAllocator(pool, [store.release_blocks] if reclaims else []), store, clock


def _finish(allocator, store, key, prompt_len, generated):
    """One call on `key`: a request's allocation, its tokens kept at the end, the allocation freed."""
    session = store.begin(key, "prompt")
    tokens = session.token_ids or list(range(prompt_len))
    allocation = allocator.allocate(len(tokens) + generated - 1)
    store.keep(session, tokens + [7] * generated, "new", allocation.block_ids)
    allocator.free(allocation)
    store.end(session, succeeded=True)
    return session


def test_a_session_keeps_the_blocks_of_its_computed_tokens_only():
    allocator, store, _ = _store()
    session = _finish(allocator, store, ("", "a"), prompt_len=6, generated=3)
    # 9 tokens, 8 computed (the last generated one never was): 2 blocks of 4
    assert session.computed == 8 and len(session.blocks) == 2 and session.text == "new"
    assert all(allocator.pool.ref_count(b) == 1 for b in session.blocks)
    assert allocator.num_free_blocks == 40 - 2
    again = _finish(allocator, store, ("", "a"), prompt_len=0, generated=2)
    assert again is session and session.computed == 10 and len(session.blocks) == 3
    assert session.text == "newnew" and allocator.num_free_blocks == 40 - 3


def test_one_call_at_a_time_per_id_and_ids_are_apart():
    _, store, _ = _store()
    first = store.begin(("", "a"), "p")
    with pytest.raises(SessionBusy):
        store.begin(("", "a"), "p")
    other = store.begin(("key-digest", "a"), "p")  # the same id under another caller
    assert other is not first
    store.end(first, succeeded=False)
    assert store.get(("", "a")) is None, "a call that generated nothing leaves no session"


def test_ttl_releases_blocks_but_keeps_tokens():
    allocator, store, clock = _store(ttl=10)
    session = _finish(allocator, store, ("", "a"), prompt_len=8, generated=1)
    clock.now = 5
    store.expire()
    assert session.blocks
    clock.now = 11
    store.expire()
    assert session.blocks == [] and session.computed == 0 and session.token_ids
    assert allocator.num_free_blocks == 40


def test_share_of_the_pool_is_kept_by_releasing_the_least_recently_used():
    allocator, store, clock = _store(kv_share=0.25)  # 10 of 40 blocks
    old = _finish(allocator, store, ("", "old"), prompt_len=17, generated=4)  # 20 computed: 5 blocks
    clock.now = 1
    new = _finish(allocator, store, ("", "new"), prompt_len=21, generated=4)  # 6 blocks: over 10
    assert old.blocks == [] and len(new.blocks) == 6
    assert store.held_blocks == 6


def test_a_short_pool_reclaims_idle_sessions_blocks_first_then_busy_ones():
    allocator, store, _ = _store(num_blocks=9, reclaims=True, kv_share=1.0)  # 8 usable
    idle = _finish(allocator, store, ("", "idle"), prompt_len=9, generated=4)  # 12: 3 blocks
    busy = _finish(allocator, store, ("", "busy"), prompt_len=9, generated=4)
    store.begin(("", "busy"), "p")
    assert allocator.num_free_blocks == 2
    allocation = allocator.allocate(20)  # 5 blocks: the idle session lets go of its 3
    assert allocation is not None and idle.blocks == [] and len(busy.blocks) == 3
    # a waiting continuation never pins the pool: its session lets go too (it recomputes)
    assert allocator.allocate(12) is not None and busy.blocks == []
    assert store.held_blocks == 0


def test_past_max_sessions_the_least_recently_used_idle_one_is_forgotten():
    allocator, store, clock = _store(max_sessions=2)
    for i, key in enumerate(("a", "b", "c")):
        clock.now = i
        _finish(allocator, store, ("", key), prompt_len=4, generated=1)
    assert store.get(("", "a")) is None and len(store) == 2
    assert allocator.num_free_blocks == 40 - 2


def test_the_queue_plans_a_continuation_from_the_blocks_its_session_holds():
    allocator, store, _ = _store()
    session = _finish(allocator, store, ("", "a"), prompt_len=6, generated=3)
    queue = RequestQueue(allocator)
    entry = QueueEntry(id=1, input_length=9, max_new_tokens=4, held_prefix=session)
    queue.append(entry)
    plan = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                            token_budget=1000)
    assert plan.entries == [entry] and entry.cache_len == 8 and plan.prefill_tokens == 1
    assert entry.allocation.block_ids[:2] == session.blocks
    assert all(allocator.pool.ref_count(b) == 2 for b in session.blocks)
    queue.put_back([entry])  # a lost step: the session still holds its blocks
    assert all(allocator.pool.ref_count(b) == 1 for b in session.blocks)


def test_a_call_that_fails_after_its_generation_leaves_the_session_as_it_was():
    allocator, store, _ = _store()
    session = _finish(allocator, store, ("", "a"), prompt_len=6, generated=3)
    before = (list(session.token_ids), list(session.blocks), session.text)
    store.begin(("", "a"), "ignored")
    allocation = allocator.allocate(12)
    store.keep(session, session.token_ids + [8, 8, 8], "more", allocation.block_ids)
    allocator.free(allocation)
    store.end(session, succeeded=False)  # e.g. another item of its batch failed
    assert (session.token_ids, session.blocks, session.text) == before
    assert allocator.num_free_blocks == 40 - 2 and store.held_blocks == 2


def test_a_call_refused_at_the_limit_costs_no_other_session():
    allocator, store, clock = _store(max_sessions=2)
    for i, key in enumerate(("a", "b")):
        clock.now = i
        _finish(allocator, store, ("", key), prompt_len=4, generated=1)
    refused = store.begin(("", "c"), "p")  # then validation or admission refuses the call
    store.end(refused, succeeded=False)
    assert store.get(("", "a")) is not None and store.get(("", "b")) is not None
    assert store.get(("", "c")) is None and len(store) == 2


def test_a_new_session_at_the_limit_with_every_other_busy_is_still_served():
    _, store, _ = _store(max_sessions=1)
    store.begin(("", "a"), "p")
    second = store.begin(("", "b"), "p")
    assert second.busy and store.get(("", "b")) is second


def test_a_continuation_reads_its_sessions_blocks_when_planned_not_when_queued():
    allocator, store, _ = _store()
    session = _finish(allocator, store, ("", "a"), prompt_len=6, generated=3)
    queue = RequestQueue(allocator)
    entry = QueueEntry(id=1, input_length=9, max_new_tokens=4, held_prefix=session)
    queue.append(entry)
    store.release_blocks(10)  # the pool ran short while it waited
    plan = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                            token_budget=1000)
    assert plan.entries == [entry] and entry.cache_len == 0 and plan.prefill_tokens == 9
