"""Queue budgets: prefill tokens, KV tokens, batch size, minimum size and FIFO order."""
import pytest

from router.kv.block_allocator import BlockAllocator, BlockPool
from router.scheduler.request_queue import QueueEntry, RequestQueue


def _queue(num_blocks=1000, block_size=1):
    return RequestQueue(BlockAllocator(BlockPool(num_blocks, block_size)))


def _entry(i, input_length=10, max_new_tokens=10):
    return QueueEntry(id=i, input_length=input_length, max_new_tokens=max_new_tokens)


def _next(queue, **kw):
    args = dict(min_size=None, max_size=None, prefill_token_budget=10_000, token_budget=10_000)
    return queue.next_batch(**{**args, **kw})


def test_prefill_budget_stops_the_scan():
    queue = _queue()
    for i in range(5):
        queue.append(_entry(i, input_length=30))
    plan = _next(queue, prefill_token_budget=100)
    assert [e.id for e in plan.entries] == [0, 1, 2]
    assert plan.prefill_tokens == 90
    assert len(queue) == 2


def test_head_of_line_is_not_overtaken():
    queue = _queue()
    queue.append(_entry(0, input_length=60))
    queue.append(_entry(1, input_length=50))
    queue.append(_entry(2, input_length=5))
    assert [e.id for e in _next(queue, prefill_token_budget=100).entries] == [0]
    assert len(queue) == 2, "the short request behind the one that did not fit waits its turn"


@pytest.mark.parametrize("prompt_ids", [[1] * 300, None], ids=["cached", "every-position"])
def test_a_prompt_over_the_whole_budget_goes_alone_in_chunks(prompt_ids):
    """One whose every position is asked for (never offered to the prefix cache) too."""
    queue = RequestQueue(BlockAllocator(BlockPool(1000, 1)), chunking=True)
    queue.append(QueueEntry(id=0, input_length=300, max_new_tokens=5, prompt_ids=prompt_ids))
    queue.append(_entry(1, input_length=5))
    plan = _next(queue, prefill_token_budget=100)
    assert [e.id for e in plan.entries] == [0] and plan.chunk_len == 100
    assert [e.id for e in _next(queue, prefill_token_budget=100).entries] == [1]


def test_kv_pool_limits_the_batch_and_allocations_are_made():
    queue = _queue(num_blocks=41, block_size=1)  # 40 usable slots
    for i in range(3):
        queue.append(_entry(i, input_length=10, max_new_tokens=11))  # 20 KV tokens each
    plan = _next(queue)
    assert [e.id for e in plan.entries] == [0, 1]
    assert all(len(e.allocation.block_ids) == 20 for e in plan.entries)
    assert queue.allocator.num_free_blocks == 0


def test_token_budget_and_max_size():
    queue = _queue()
    for i in range(4):
        queue.append(_entry(i))
    assert [e.id for e in _next(queue, token_budget=40).entries] == [0, 1]
    assert [e.id for e in _next(queue, max_size=1).entries] == [2]


def test_below_min_size_takes_nothing_and_frees_allocations():
    queue = _queue(num_blocks=101, block_size=1)
    queue.append(_entry(0))
    queue.append(_entry(1))
    assert _next(queue, min_size=3) is None
    assert queue.allocator.num_free_blocks == 100
    queue.append(_entry(2))
    queue.append(_entry(3, input_length=500))
    assert _next(queue, min_size=4) is None, "only three fit the pool"
    assert queue.allocator.num_free_blocks == 100
    assert [e.id for e in _next(queue, min_size=3).entries] == [0, 1, 2]


def test_removed_entries_leave_and_batch_ids_increase():
    queue = _queue()
    entries = [_entry(i) for i in range(3)]
    for e in entries:
        queue.append(e)
    assert queue.remove(entries[1])
    assert not queue.remove(entries[1])
    first = _next(queue, max_size=1)
    second = _next(queue)
    assert [e.id for e in first.entries] == [0] and [e.id for e in second.entries] == [2]
    assert second.batch_id == first.batch_id + 1


def test_an_error_while_planning_puts_every_taken_entry_back_with_its_blocks():
    import pytest

    queue = _queue()
    for i in range(3):
        queue.append(_entry(i))
    real, calls = queue.allocator.allocate, []

    def allocate(num_tokens, **kw):
        calls.append(num_tokens)
        if len(calls) == 3:
            raise RuntimeError("a bug")
        return real(num_tokens, **kw)
    queue.allocator.allocate = allocate
    with pytest.raises(RuntimeError):
        _next(queue)
    assert [e.id for e in queue.entries()] == [0, 1, 2], "nothing is stranded outside the queue"
    assert all(e.allocation is None for e in queue.entries())
    assert queue.allocator.num_free_blocks == queue.allocator.num_usable_blocks
