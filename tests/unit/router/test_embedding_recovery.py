"""Embedding inputs while the shard group restarts: they wait on the batching loop's recovery.

A fake group that dies and comes back (the batcher's real recovery notices it and reconnects);
embedding calls sent meanwhile wait for it and are answered by the new group, within the same
bound, replay budget and shutdown rules as queued generation requests.
"""
import asyncio

import pytest

from router.core.embedding import EmbeddingQueue
from router.errors import GenerationError, UnhealthyError
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.scheduler import batcher as batcher_module
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.recovery import RecoveryPolicy
from router.scheduler.request_queue import RequestQueue
from router.shards.client import ShardError
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient
from tests.waiting import wait_until_async

KILLER = 66  # an input opening with it kills the group each time it is computed


class _Group:
    """A shard group that can die and come back; its Embed calls answer each input's length."""

    def __init__(self, *, comes_back_after: float = 0.05, timeout: float = 5.0,
                 dies_on_second_chunk: bool = False):
        self.alive = True
        self.dies_on_second_chunk = dies_on_second_chunk  # once: the call that continues one
        self.generation = 0  # bumped by each restart
        self.comes_back_after = comes_back_after
        self.calls: list[list[tuple[int, int, int | None]]] = []  # (length, start, chunk)
        self.policy = RecoveryPolicy(reconnect=self.reconnect, is_alive=self.is_alive,
                                     timeout=timeout)

    async def is_alive(self):
        return self.alive

    async def reconnect(self):
        await asyncio.sleep(min(self.comes_back_after, 0.01))
        if self.comes_back_after == float("inf"):
            raise ConnectionError("still down")
        await asyncio.sleep(self.comes_back_after)
        self.alive, self.generation = True, self.generation + 1
        return 100

    async def embed(self, inputs):
        self.calls.append([(len(ids), start, chunk) for _, ids, start, chunk in inputs])
        await asyncio.sleep(0.001)
        if any(ids[0] == KILLER for _, ids, _, _ in inputs):
            self.alive = False
        if self.dies_on_second_chunk and any(start for _, _, start, _ in inputs):
            self.alive = self.dies_on_second_chunk = False
        if not self.alive:
            raise ShardError("failed to connect to all addresses", "UNAVAILABLE")
        ended = [(i, ids) for i, ids, _, chunk in inputs if chunk is None]
        return {i: [float(len(ids)), float(self.generation)] for i, ids in ended}, {}, 1000


@pytest.fixture
def fast_probe(monkeypatch):
    monkeypatch.setattr(batcher_module, "IDLE_PROBE_S", 0.02)


async def _with_batcher(group: _Group, scenario, decode_s=lambda: None):
    """Runs `scenario(batcher, queue)` beside a batching loop whose recovery watches `group`."""
    allocator = BlockAllocator(BlockPool(100, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=0.0, max_waiting_tokens=20, max_batch_size=None)
    batcher = Batcher(FakeShardClient(), RequestQueue(allocator), allocator, limits,
                      Metrics(max_input_tokens=100, max_total_tokens=200), group.policy)
    queue = EmbeddingQueue(group, decode_s=decode_s, recovery=batcher.recovery)
    loop = asyncio.create_task(batcher.run())
    try:
        return await asyncio.wait_for(scenario(batcher, queue), 10)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_an_input_sent_right_after_the_group_died_is_served_by_the_new_one(fast_probe):
    group = _Group()

    async def scenario(batcher, queue):
        assert await queue.embed([[1, 2]]) == [[2.0, 0.0]]
        group.alive = False  # the loop has not noticed yet: the call fails, then waits
        first = asyncio.create_task(queue.embed([[1, 2, 3]]))
        await wait_until_async(lambda: not batcher.healthy, "the loss to be found")
        later = await queue.embed([[4]])  # sent while the loop waits for the group
        return await first, later

    first, later = await _with_batcher(group, scenario)
    assert first == [[3.0, 1.0]] and later == [[1.0, 1.0]], "computed by the new group"
    assert group.generation == 1


async def test_inputs_wait_no_longer_than_queued_requests_and_not_through_a_stop(fast_probe):
    group = _Group(comes_back_after=float("inf"), timeout=0.3)

    async def scenario(batcher, queue):
        group.alive = False
        answers = await asyncio.gather(queue.embed([[1]]), queue.embed([[2, 3]]),
                                       return_exceptions=True)
        stopping = asyncio.create_task(queue.embed([[5]]))
        await asyncio.sleep(0.05)
        batcher.stop_waiting()  # SIGTERM while the group is away: nothing waits for it
        return answers, await asyncio.gather(stopping, return_exceptions=True)

    answers, (stopped,) = await _with_batcher(group, scenario)
    assert all(isinstance(a, UnhealthyError) and a.status == 503 for a in answers), answers
    assert "did not come back within" in str(answers[0])
    assert isinstance(stopped, UnhealthyError) and "being stopped" in str(stopped)


async def test_an_input_that_kills_the_group_each_time_runs_twice_and_fails(fast_probe):
    group = _Group()

    async def scenario(batcher, queue):
        (killer,) = await asyncio.gather(queue.embed([[KILLER, 1]]), return_exceptions=True)
        return killer, await queue.embed([[7]])

    killer, other = await _with_batcher(group, scenario)
    assert isinstance(killer, GenerationError) and killer.status == 424, killer
    assert other == [[1.0, 2.0]], "computed after the second restart"
    assert [call for call in group.calls if call[0][0] == 2] == [[(2, 0, None)]] * 2
    assert group.generation == 2


async def test_a_client_that_leaves_while_waiting_is_never_computed(fast_probe):
    group = _Group(comes_back_after=0.2)

    async def scenario(batcher, queue):
        group.alive = False
        leaving = asyncio.create_task(queue.embed([[9, 9, 9, 9, 9]]))
        await wait_until_async(lambda: not batcher.healthy, "the loss to be found")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await wait_until_async(lambda: batcher.healthy, "the group to be back")
        return await queue.embed([[1]])

    assert await _with_batcher(group, scenario) == [[1.0, 1.0]]
    assert [call for call in group.calls if call[0][0] == 5] == [[(5, 0, None)]], \
        "sent once, before the loss; not again once its client had left"


async def test_a_decoders_input_in_chunks_starts_over_on_the_new_group(fast_probe):
    """The new group holds none of the chunks the old one computed: the input goes whole again."""
    group = _Group(dies_on_second_chunk=True)
    decode = {"s": 0.001}  # a batch decodes beside it: chunks of about half a step's tokens

    async def scenario(batcher, queue):
        queue.s_per_token = 0.001 / 8
        embedding = asyncio.create_task(queue.embed([[1] * 10]))
        await wait_until_async(lambda: not batcher.healthy, "the loss to be found")
        decode["s"] = None  # nothing decodes on the new group: the input goes in one call
        return await embedding

    assert await _with_batcher(group, scenario, decode_s=lambda: decode["s"]) == [[10.0, 1.0]]
    (first,), (lost,), (again,) = group.calls
    assert first == (10, 0, 4) and lost[1] == 4 and again == (10, 0, None)
