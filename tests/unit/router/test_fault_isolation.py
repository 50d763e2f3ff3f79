"""One request's failure stays with it; a lost shard group is waited for; the loop never dies.

A failure is injected at each stage of one request's way through the batching loop (its message
cannot be built, the shard refuses it, its generation cannot be read back; test_shard_convert shows
the real client reports those the way the fake does here), among several requests: the others
finish with the tokens they get alone, the failed one gets a GenerationError, and every KV block
comes back.
"""
import asyncio

import pytest

from router.core.generation import Infer
from router.errors import GenerationError, UnhealthyError
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.scheduler import batcher as batcher_module
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.recovery import RecoveryPolicy
from router.scheduler.request_queue import RequestQueue
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.shards.step_types import RequestFailedInShard
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient
from tests.waiting import wait_until_async

POISON = 99  # the first prompt token of the request a test makes fail


def _setup(client, *, chunking=False, recovery=None, num_blocks=200):
    allocator = BlockAllocator(BlockPool(num_blocks, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=0.0, max_waiting_tokens=20, max_batch_size=None)
    metrics = Metrics(max_input_tokens=100, max_total_tokens=200)
    batcher = Batcher(client, RequestQueue(allocator, chunking=chunking), allocator, limits,
                      metrics, recovery)
    return batcher, Infer(batcher, metrics, max_concurrent_requests=64), allocator


def _request(max_new_tokens, first_token=5, length=8):
    return GenerateRequest(inputs="x", input_ids=[first_token] + [5] * (length - 1),
                           sampling=SamplingParams(),
                           stopping=StoppingParams(max_new_tokens=max_new_tokens))


async def _run(batcher, coro, timeout=10):
    task = asyncio.create_task(batcher.run())
    try:
        return await asyncio.wait_for(coro, timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _settle(allocator):
    for _ in range(200):
        if allocator.num_free_blocks == allocator.num_usable_blocks:
            return
        await asyncio.sleep(0.005)


def _poisoned(request) -> bool:
    return request.request.input_ids[0] == POISON


def _inject_untranslatable(client):
    client.untranslatable = lambda r: ValueError("injected failure") if _poisoned(r) else None


def _inject_unreadable(client):
    # its third token cannot be read back
    client.unreadable = lambda r, count: (ValueError("injected failure")
                                          if _poisoned(r) and count == 3 else None)


def _inject_ended_in_shard(client):
    # at its third token the shard ends it as one it cannot go on with (Generation.error)
    client.unreadable = lambda r, count: (
        RequestFailedInShard("injected failure: the grammar could not go on")
        if _poisoned(r) and count == 3 else None)


def _inject_shard_refusal(client):
    client.refuse = lambda r: ("injected failure: its grammar does not compile"
                               if _poisoned(r) else None)


@pytest.mark.parametrize("chunking", [False, True], ids=["separate-prefill", "fused-prefill"])
@pytest.mark.parametrize("inject", [_inject_untranslatable, _inject_unreadable,
                                    _inject_ended_in_shard, _inject_shard_refusal],
                         ids=["untranslatable", "unreadable", "ended-in-shard", "shard-refusal"])
async def test_a_failure_in_one_requests_data_fails_it_alone(inject, chunking):
    lengths = [4, 6, 5, 7]

    async def outcomes(poison_index):
        client = FakeShardClient(step_delay=0.001)
        batcher, infer, allocator = _setup(client, chunking=chunking)
        if poison_index is not None:
            inject(client)

        async def one(i, n):
            await asyncio.sleep(0.002 * i)  # some join a running batch, some start it
            first = POISON if i == poison_index else 5
            return await infer.generate(_request(n, first_token=first))

        async def scenario():
            results = await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)),
                                           return_exceptions=True)
            await _settle(allocator)
            return results

        results = await _run(batcher, scenario())
        assert allocator.num_free_blocks == allocator.num_usable_blocks, "every KV block came back"
        assert client.batches == {}, "the shard holds no batch"
        return results

    alone = await outcomes(None)
    for poison_index in (0, 2):
        results = await outcomes(poison_index)
        failed = results[poison_index]
        assert isinstance(failed, GenerationError) and "injected failure" in str(failed)
        for i, (result, reference) in enumerate(zip(results, alone)):
            if i != poison_index:
                assert result.final.text == reference.final.text
                assert [t.id for t in result.tokens] == [t.id for t in reference.tokens]


async def test_an_untranslatable_request_fails_with_its_own_error_before_the_step():
    client = FakeShardClient(step_delay=0.001)
    _inject_untranslatable(client)
    client.fail_next = "prefill"  # the step it would have been in fails
    batcher, infer, allocator = _setup(client)
    results = await _run(batcher, asyncio.gather(
        infer.generate(_request(3, first_token=POISON)), infer.generate(_request(3)),
        return_exceptions=True))
    untranslatable, in_the_step = results
    assert "ValueError: injected failure" in str(untranslatable)
    assert "injected prefill failure" in str(in_the_step)
    await _settle(allocator)
    assert allocator.num_free_blocks == allocator.num_usable_blocks


async def test_a_batch_of_untranslatable_requests_sends_nothing_and_counts_no_step():
    client = FakeShardClient(step_delay=0.001)
    _inject_untranslatable(client)
    batcher, infer, allocator = _setup(client)
    results = await _run(batcher, asyncio.gather(
        *(infer.generate(_request(3, first_token=POISON)) for _ in range(3)),
        return_exceptions=True))
    assert all(isinstance(r, GenerationError) for r in results)
    assert client.calls == []
    rendered = batcher.metrics.render().decode()
    assert 'tgi_batch_inference_count{method="prefill"}' not in rendered
    assert allocator.num_free_blocks == allocator.num_usable_blocks


async def test_an_error_outside_any_request_fails_those_in_flight_and_the_loop_goes_on(
        monkeypatch):
    client = FakeShardClient(step_delay=0.001)
    batcher, infer, allocator = _setup(client)
    real = batcher.steps.decode
    calls = {"n": 0}

    async def broken_once(batches, max_steps=1):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug in the loop")
        return await real(batches, max_steps)
    monkeypatch.setattr(batcher.steps, "decode", broken_once)

    async def scenario():
        first = await asyncio.gather(infer.generate(_request(6)), return_exceptions=True)
        later = await infer.generate(_request(3))  # the loop still serves
        await _settle(allocator)
        return first[0], later

    failed, later = await _run(batcher, scenario())
    assert isinstance(failed, GenerationError)
    assert later.final.text == "t1 t2 t3 "
    assert allocator.num_free_blocks == allocator.num_usable_blocks


class _Shards:
    """A recovery policy over a fake shard that can die and come back."""

    def __init__(self, client: FakeShardClient, *, comes_back_after: float = 0.05,
                 timeout: float = 5.0, num_blocks: int = 150):
        self.client = client
        self.alive = True
        self.reconnects = 0
        self.comes_back_after = comes_back_after
        self.num_blocks = num_blocks
        self.policy = RecoveryPolicy(reconnect=self.reconnect, is_alive=self.is_alive,
                                     timeout=timeout)

    async def is_alive(self):
        return self.alive

    async def reconnect(self):
        if self.comes_back_after == float("inf"):
            await asyncio.sleep(0.01)
            raise ConnectionError("still down")
        await asyncio.sleep(self.comes_back_after)
        self.alive = True
        self.reconnects += 1
        self.client.batches.clear()  # a restarted shard has an empty cache
        return self.num_blocks

    def kill(self):
        self.alive = False


async def test_a_lost_shard_fails_streams_with_tokens_and_reruns_those_without():
    client = FakeShardClient(step_delay=0.002)
    shards = _Shards(client)
    batcher, infer, allocator = _setup(client, recovery=shards.policy)

    async def scenario():
        streaming = asyncio.create_task(infer.generate(_request(30)))
        while not client.generated or max(client.generated.values()) < 3:
            await asyncio.sleep(0.001)
        shards.kill()
        client.fail_next = "decode"
        queued = asyncio.create_task(infer.generate(_request(4)))  # waits for the new shards
        results = await asyncio.gather(streaming, queued, return_exceptions=True)
        assert batcher.healthy
        return results

    streamed, queued = await _run(batcher, scenario())
    assert isinstance(streamed, GenerationError), "it had tokens: it fails, it is not replayed"
    assert queued.final.text == "t1 t2 t3 t4 "
    assert shards.reconnects == 1
    assert allocator.num_blocks == 150, "the pool was sized again from the new warm-up"
    assert allocator.num_free_blocks == allocator.num_usable_blocks


async def test_a_prefill_lost_with_the_shards_runs_again_once_they_are_back():
    client = FakeShardClient(step_delay=0.002)
    shards = _Shards(client)
    batcher, infer, allocator = _setup(client, recovery=shards.policy)
    shards.kill()
    client.fail_next = "prefill"  # the shard died before the request's first token
    result = await _run(batcher, infer.generate(_request(3)))
    assert result.final.text == "t1 t2 t3 "
    assert [name for name, _ in client.calls].count("prefill") == 2


def _shards_that_stay_away(timeout: float):
    """A batcher whose shards die at the next prefill and never come back."""
    client = FakeShardClient(step_delay=0.002)
    shards = _Shards(client, comes_back_after=float("inf"), timeout=timeout)
    batcher, infer, _ = _setup(client, recovery=shards.policy)
    shards.kill()
    client.fail_next = "prefill"
    return batcher, infer


async def test_requests_waiting_for_shards_that_do_not_come_back_get_503():
    batcher, infer = _shards_that_stay_away(timeout=0.3)

    async def scenario():
        first = asyncio.create_task(infer.generate(_request(3)))
        await wait_until_async(lambda: not batcher.healthy, "the loss of the shards to be found")
        assert not batcher.healthy
        later = asyncio.create_task(infer.generate(_request(3)))
        return await asyncio.gather(first, later, return_exceptions=True)

    results = await _run(batcher, scenario())
    assert all(isinstance(r, UnhealthyError) and r.status == 503 for r in results), results
    assert len(batcher.queue) == 0


async def test_an_idle_router_notices_a_restarted_group_before_the_next_request(monkeypatch):
    monkeypatch.setattr(batcher_module, "IDLE_PROBE_S", 0.02)
    client = FakeShardClient()
    shards = _Shards(client)
    batcher, infer, allocator = _setup(client, recovery=shards.policy)

    async def scenario():
        shards.kill()
        while shards.reconnects == 0:
            await asyncio.sleep(0.01)
        return await infer.generate(_request(2))

    result = await _run(batcher, scenario())
    assert result.final.text == "t1 t2 "
    assert [name for name, _ in client.calls].count("prefill") == 1, "nothing failed on the way"


async def test_a_router_stopping_while_the_shards_are_away_answers_the_waiting_with_503():
    batcher, infer = _shards_that_stay_away(timeout=60)

    async def scenario():
        waiting = asyncio.create_task(infer.generate(_request(3)))
        await wait_until_async(lambda: not batcher.healthy, "the loss of the shards to be found")
        assert not batcher.healthy
        batcher.stop_waiting()
        return await asyncio.gather(waiting, return_exceptions=True)

    (result,) = await _run(batcher, scenario(), timeout=5)
    assert isinstance(result, UnhealthyError) and "being stopped" in str(result)


async def test_a_loss_found_after_the_stop_fails_the_requests_instead_of_requeueing_them():
    batcher, infer = _shards_that_stay_away(timeout=60)
    batcher.stop_waiting()  # SIGTERM arrived while the shards still looked healthy
    (result,) = await _run(batcher, asyncio.gather(infer.generate(_request(3)),
                                                   return_exceptions=True), timeout=5)
    assert isinstance(result, UnhealthyError)


async def test_the_batch_running_when_the_shards_were_lost_is_not_sent_to_the_new_ones():
    client = FakeShardClient(step_delay=0.002)
    shards = _Shards(client)
    batcher, infer, allocator = _setup(client, recovery=shards.policy)

    async def scenario():
        running = asyncio.create_task(infer.generate(_request(30)))
        while not client.generated or max(client.generated.values()) < 3:
            await asyncio.sleep(0.001)
        shards.kill()
        client.fail_next = "prefill"  # a new request's prefill finds the shards gone
        late = asyncio.create_task(infer.generate(_request(3)))
        return await asyncio.gather(running, late, return_exceptions=True)

    running, late = await _run(batcher, scenario())
    assert isinstance(running, GenerationError)
    assert late.final.text == "t1 t2 t3 "
    # the old batch died with the old shards: decoding it on the new ones would fail
    assert batcher.metrics.counters.value("tgi_batch_inference_failure", method="decode") == 0
    assert allocator.num_free_blocks == allocator.num_usable_blocks


async def test_a_long_prompt_refused_by_the_shard_mid_chunks_stops_chunking_and_frees_it():
    client = FakeShardClient(step_delay=0.001)
    refused_at = {}

    def refuse(request):
        if request.request.input_ids[0] == POISON and request.cache_len > 0:  # its second chunk
            refused_at["cache_len"] = request.cache_len
            return "injected failure"
        return None
    client.refuse = refuse
    batcher, infer, allocator = _setup(client, chunking=True)

    async def scenario():
        short = asyncio.create_task(infer.generate(_request(20)))
        await wait_until_async(lambda: client.generated, "the short request to be running")
        long = asyncio.gather(infer.generate(_request(4, first_token=POISON, length=150)),
                              return_exceptions=True)
        results = [await short, (await long)[0]]
        await _settle(allocator)
        return results

    short, long = await _run(batcher, scenario())
    assert short.final.generated_tokens == 20
    assert isinstance(long, GenerationError) and refused_at["cache_len"] > 0
    assert batcher.chunked is None
    assert allocator.num_free_blocks == allocator.num_usable_blocks


async def test_an_error_in_the_idle_probe_does_not_stop_the_loop(monkeypatch):
    monkeypatch.setattr(batcher_module, "IDLE_PROBE_S", 0.01)
    client = FakeShardClient()
    shards = _Shards(client)
    probes = {"n": 0}

    async def broken_probe():
        probes["n"] += 1
        if probes["n"] == 1:
            raise RuntimeError("a bug in the probe")
        return True
    shards.policy.is_alive = broken_probe
    batcher, infer, allocator = _setup(client, recovery=shards.policy)

    async def scenario():
        while probes["n"] < 3:
            await asyncio.sleep(0.01)
        return await infer.generate(_request(2))

    result = await _run(batcher, scenario())
    assert result.final.text == "t1 t2 "
