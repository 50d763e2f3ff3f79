"""The batching loop on a fake shard: joins, filters, cancellation, failures, no leaked blocks."""
import asyncio
import time

import pytest

from router.core.generation import Infer
from router.errors import GenerationError
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.scheduler.batcher import Batcher
from router.scheduler.chunk_sizing import MIN_CHUNK_TOKENS
from router.scheduler.policy import SchedulingLimits
from router.scheduler.request_queue import RequestQueue
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient
from tests.waiting import wait_until_async


def _setup(client, *, num_blocks=200, max_batch_size=None, ratio=0.0, max_waiting_tokens=20,
           chunking=False, max_decode_steps=1, stream_decode_steps=False):
    allocator = BlockAllocator(BlockPool(num_blocks, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=ratio,
                              max_waiting_tokens=max_waiting_tokens,
                              max_batch_size=max_batch_size, max_decode_steps=max_decode_steps,
                              stream_decode_steps=stream_decode_steps)
    metrics = Metrics(max_input_tokens=100, max_total_tokens=200)
    batcher = Batcher(client, RequestQueue(allocator, chunking=chunking), allocator, limits,
                      metrics)
    return batcher, Infer(batcher, metrics, max_concurrent_requests=64), allocator


def _request(max_new_tokens, length=8):
    return GenerateRequest(inputs="x", input_ids=[5] * length, sampling=SamplingParams(),
                           stopping=StoppingParams(max_new_tokens=max_new_tokens))


def _assert_all_freed(allocator, client):
    assert allocator.num_free_blocks == allocator.num_usable_blocks, "every KV block came back"
    assert client.batches == {}, "the shard holds no batch"


async def _with_loop(batcher, coro):
    task = asyncio.create_task(batcher.run())
    try:
        return await asyncio.wait_for(coro, timeout=10)
    finally:
        task.cancel()


async def test_requests_join_a_running_batch_and_all_finish():
    client = FakeShardClient(step_delay=0.001)
    batcher, infer, allocator = _setup(client)

    async def late(i, delay):
        await asyncio.sleep(delay)
        return await infer.generate(_request(max_new_tokens=3 + i))

    results = await _with_loop(batcher, asyncio.gather(*(late(i, 0.003 * i) for i in range(6))))
    assert [r.final.generated_tokens for r in results] == [3, 4, 5, 6, 7, 8]
    assert [r.final.text for r in results][0] == "t1 t2 t3 "
    assert any(name == "decode" and len(ids) == 2 for name, ids in client.calls), \
        "a new prefill was merged into the running batch"
    _assert_all_freed(allocator, client)


async def test_cancelled_stream_leaves_at_next_step_and_frees_blocks():
    client = FakeShardClient(step_delay=0.005)
    batcher, infer, allocator = _setup(client)

    async def drop_after_two():
        stream = infer.stream(_request(max_new_tokens=50))
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return got

    async def scenario():
        other = asyncio.create_task(infer.generate(_request(max_new_tokens=10)))
        await drop_after_two()
        await other
        for _ in range(100):
            if allocator.num_free_blocks == allocator.num_usable_blocks:
                break
            await asyncio.sleep(0.01)

    await _with_loop(batcher, scenario())
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    assert infer.in_flight == 0
    assert any(name == "filter" for name, _ in client.calls)


async def test_shard_failure_fails_the_requests_and_frees_blocks():
    client = FakeShardClient()
    client.fail_next = "prefill"
    batcher, infer, allocator = _setup(client)
    with pytest.raises(GenerationError, match="injected prefill failure"):
        await _with_loop(batcher, infer.generate(_request(max_new_tokens=4)))
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    result = await _with_loop(batcher, infer.generate(_request(max_new_tokens=4)))
    assert result.final.generated_tokens == 4


async def test_max_batch_size_bounds_the_running_batch():
    client = FakeShardClient(step_delay=0.001)
    batcher, infer, _ = _setup(client, max_batch_size=2)
    results = await _with_loop(batcher, asyncio.gather(*(infer.generate(_request(5))
                                                         for _ in range(5))))
    assert all(r.final.generated_tokens == 5 for r in results)
    assert max(client.decode_sizes) == 2


async def _decodes_before_late_prefill(ratio: float, chunking: bool = False) -> int:
    client = FakeShardClient(step_delay=0.01)
    batcher, infer, _ = _setup(client, ratio=ratio, chunking=chunking)
    batcher.limits.max_waiting_tokens = 6

    async def scenario():
        running = [asyncio.ensure_future(infer.generate(_request(30))) for _ in range(4)]
        while not any(name == "decode" for name, _ in client.calls):
            await asyncio.sleep(0.001)
        client.calls.append(("late request submitted", None))
        late = asyncio.ensure_future(infer.generate(_request(3)))
        await asyncio.gather(late, *running)

    await _with_loop(batcher, scenario())
    marker = client.calls.index(("late request submitted", None))
    second_prefill = next(i for i, (name, _) in enumerate(client.calls) if i > marker
                          and name == "prefill")
    return sum(1 for name, _ in client.calls[marker:second_prefill] if name == "decode")


async def test_waiting_served_ratio_holds_a_lone_request_until_max_waiting_tokens():
    # one waiting request is fewer than 4 running x 0.5: it waits for max_waiting_tokens steps
    assert await _decodes_before_late_prefill(0.5) >= 3
    # with no ratio it joins at the next step
    assert await _decodes_before_late_prefill(0.0) <= 1


async def test_with_shards_that_chunk_a_lone_request_joins_at_once_whatever_the_ratio():
    """TGI ignores the join rule when the shards chunk: the newcomer's prefill carries the
    running batch's step, so the running requests lose no step to it."""
    assert await _decodes_before_late_prefill(0.5, chunking=True) <= 1


async def test_a_long_prompt_is_prefilled_in_chunks_that_carry_the_running_batch():
    client = FakeShardClient(step_delay=0.002)
    allocator = BlockAllocator(BlockPool(400, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=0.0, max_waiting_tokens=20, max_batch_size=None)
    metrics = Metrics(max_input_tokens=1000, max_total_tokens=2000)
    batcher = Batcher(client, RequestQueue(allocator, chunking=True), allocator, limits, metrics)
    infer = Infer(batcher, metrics, max_concurrent_requests=64)

    async def scenario():
        running = [asyncio.ensure_future(infer.generate(_request(30))) for _ in range(3)]
        while not any(name == "decode" for name, _ in client.calls):
            await asyncio.sleep(0.001)
        long = await infer.generate(_request(5, length=300))
        await asyncio.gather(*running)
        return long

    long = await _with_loop(batcher, scenario())
    assert long.final.generated_tokens == 5
    chunks = [(i, c) for i, c in enumerate(client.calls) if c[0] == "chunk"]
    spans = [c[1][1:] for _, c in chunks]  # (start, length): contiguous from 0, within the budget
    assert spans[0][0] == 0 and len(spans) >= 4
    assert all(start + length == following for (start, length), (following, _)
               in zip(spans, spans[1:]))
    assert all(MIN_CHUNK_TOKENS <= length <= 64 for _, length in spans)
    assert spans[-1][0] + spans[-1][1] < 300
    # the running streams take their step inside each chunk's forward (TGI's cached_batch)
    for i, _ in chunks:
        assert client.calls[i + 1][0] == "step", "the running batch rides in the chunk's forward"
    final = next(i for i, c in enumerate(client.calls) if c[0] == "prefill" and i > chunks[-1][0])
    assert final > chunks[-1][0]
    assert allocator.num_free_blocks == allocator.num_usable_blocks


def _chunking_setup(client):
    allocator = BlockAllocator(BlockPool(400, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=0.0, max_waiting_tokens=20, max_batch_size=None)
    metrics = Metrics(max_input_tokens=1000, max_total_tokens=2000)
    batcher = Batcher(client, RequestQueue(allocator, chunking=True), allocator, limits, metrics)
    return batcher, Infer(batcher, metrics, max_concurrent_requests=64), allocator


async def _two_decoding(infer, client) -> list:
    running = [asyncio.ensure_future(infer.generate(_request(40))) for _ in range(2)]
    while not any(name == "decode" for name, _ in client.calls):
        await asyncio.sleep(0.001)
    return running


async def _chunks_started(client):
    while not any(name == "chunk" for name, _ in client.calls):
        await asyncio.sleep(0.001)


async def test_short_prompts_arriving_meanwhile_go_between_a_long_prompts_chunks():
    """One long prompt must not hold back every request that arrives while it is computed."""
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        long = asyncio.ensure_future(infer.generate(_request(5, length=600)))
        await _chunks_started(client)
        short = await infer.generate(_request(2, length=8))
        return short, await long, await asyncio.gather(*running)

    short, long, _ = await _with_loop(batcher, scenario())
    assert short.final.generated_tokens == 2 and long.final.generated_tokens == 5
    chunks = [i for i, c in enumerate(client.calls) if c[0] == "chunk"]
    short_prefill = next(i for i, c in enumerate(client.calls)
                         if c[0] == "prefill" and i > chunks[0])
    assert chunks[0] < short_prefill < chunks[-1], "prefilled before the long prompt's end"
    assert allocator.num_free_blocks == allocator.num_usable_blocks


class _SlowChunks(FakeShardClient):
    """A shard whose chunk steps take `chunk_s` more than a plain step."""

    def __init__(self, *, chunk_s: float, step_delay: float):
        super().__init__(step_delay=step_delay)
        self.chunk_s = chunk_s

    async def prefill(self, batch, cached_batch=None):
        if batch.message.requests[0].chunk_len is not None:
            await asyncio.sleep(self.chunk_s)
        return await super().prefill(batch, cached_batch)


async def test_chunks_costing_more_than_a_step_are_spaced_by_decode_steps():
    """Even the smallest chunk can cost several decode steps (a prefill forward's own cost): the
    streams then decode alone between two chunks, so that their steps average at most 1 + r (r:
    the prompt's share, a quarter beside two streams)."""
    client = _SlowChunks(chunk_s=0.01, step_delay=0.002)  # a chunk: five decode steps
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        long = asyncio.ensure_future(infer.generate(_request(5, length=300)))
        return await asyncio.gather(long, *running)

    await _with_loop(batcher, scenario())
    names = [name for name, _ in client.calls]
    chunks = [i for i, name in enumerate(names) if name == "chunk"]
    between = [names[a + 1:b].count("decode") for a, b in zip(chunks, chunks[1:])]
    # while the streams run (their 40 tokens), then back to back once nothing decodes
    assert len(between) >= 4 and all(n >= 6 for n in between[:2]) and between[-1] == 0, between
    _assert_all_freed(allocator, client)


async def test_a_failed_chunk_fails_the_running_batch_riding_in_it_and_frees_everything():
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        long = asyncio.ensure_future(infer.generate(_request(5, length=300)))
        await _chunks_started(client)
        client.fail_next = "prefill"
        return await asyncio.gather(long, *running, return_exceptions=True)

    results = await _with_loop(batcher, scenario())
    assert all(isinstance(r, GenerationError) for r in results), results
    _assert_all_freed(allocator, client)
    after = await _with_loop(batcher, infer.generate(_request(4)))
    assert after.final.generated_tokens == 4


async def test_a_long_prompt_cancelled_between_chunks_leaves_the_running_batch_going():
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        stream = infer.stream(_request(5, length=300))
        long = asyncio.ensure_future(anext(stream))
        await _chunks_started(client)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        await stream.aclose()
        return await asyncio.gather(*running)

    results = await _with_loop(batcher, scenario())
    assert [r.final.generated_tokens for r in results] == [40, 40]
    for _ in range(100):
        if allocator.num_free_blocks == allocator.num_usable_blocks:
            break
        await asyncio.sleep(0.01)
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    assert batcher.chunked is None


async def test_with_chunking_shards_new_requests_join_inside_the_running_batchs_step():
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        late = [asyncio.ensure_future(infer.generate(_request(5 + i))) for i in range(3)]
        return await asyncio.gather(*running, *late)

    results = await _with_loop(batcher, scenario())
    assert [r.final.generated_tokens for r in results] == [40, 40, 5, 6, 7]
    fused = [i for i, (name, _) in enumerate(client.calls) if name == "step"]
    assert fused and all(client.calls[i - 1][0] == "prefill" for i in fused), \
        "the late prefills carried the running batch's step"
    assert not any(name == "decode" and len(ids) > 1 for name, ids in client.calls)
    _assert_all_freed(allocator, client)


async def test_a_failed_fused_prefill_fails_the_riding_batch_too_and_frees_everything():
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        running = await _two_decoding(infer, client)
        client.fail_next = "prefill"
        late = asyncio.ensure_future(infer.generate(_request(5)))
        return await asyncio.gather(late, *running, return_exceptions=True)

    results = await _with_loop(batcher, scenario())
    assert all(isinstance(r, GenerationError) for r in results), results
    _assert_all_freed(allocator, client)


async def _outliving_two_streams(infer, client, *, length: int) -> asyncio.Future:
    """A long prompt's request, started beside two streams, once its chunks began and they ended."""
    running = await _two_decoding(infer, client)
    long = asyncio.ensure_future(infer.generate(_request(5, length=length)))
    await _chunks_started(client)
    await asyncio.gather(*running)
    return long


async def test_a_request_sent_right_after_the_streams_ended_goes_before_the_next_chunk():
    """Clients sending requests back to back leave the batch empty for a moment: a chunk that
    is not due yet waits out that gap instead of making their next request wait for it."""
    client = _SlowChunks(chunk_s=0.05, step_delay=0.002)  # the next chunk waits about 0.1 s
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        long = await _outliving_two_streams(infer, client, length=600)
        ended = len(client.calls)
        await infer.generate(_request(2, length=8))
        return ended, await long

    ended, _ = await _with_loop(batcher, scenario())
    after = [name for name, _ in client.calls[ended:]]
    assert after.index("prefill") < after.index("chunk"), after
    _assert_all_freed(allocator, client)


async def test_a_long_prompt_left_alone_by_the_streams_goes_on_at_once():
    """Its chunks' spacing was for the streams beside it: once they end and nothing arrives, it
    does not sit out the second of a chunk that cost many decode steps."""
    client = _SlowChunks(chunk_s=0.3, step_delay=0.002)  # the next chunk waits about 0.6 s
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        long = await _outliving_two_streams(infer, client, length=300)
        ended, calls = time.monotonic(), len(client.calls)
        await long
        return time.monotonic() - ended, [name for name, _ in client.calls[calls:]]

    left, calls = await _with_loop(batcher, scenario())
    computing = calls.count("chunk") * 0.3
    assert left - computing < 0.25, (left, calls)  # waited 0.6 s a chunk before
    _assert_all_freed(allocator, client)


async def test_the_batch_size_gauge_follows_a_batch_that_shrinks_inside_chunk_steps():
    class GaugeWatchingShard(FakeShardClient):
        def __init__(self):
            super().__init__(step_delay=0.002)
            self.seen: list[tuple[int, float]] = []  # (riding batch size, gauge) per step-carrying call

        async def prefill(self, batch, cached_batch=None):
            if cached_batch is not None:
                self.seen.append((len(cached_batch.request_ids), _gauge(batcher, "tgi_batch_current_size")))
            return await super().prefill(batch, cached_batch)

    client = GaugeWatchingShard()
    batcher, infer, allocator = _chunking_setup(client)

    async def scenario():
        # streams that finish one by one while the long prompt's chunks carry their steps
        running = [asyncio.ensure_future(infer.generate(_request(3 + 20 * i))) for i in range(3)]
        while not any(name == "decode" for name, _ in client.calls):
            await asyncio.sleep(0.001)
        long = asyncio.ensure_future(infer.generate(_request(5, length=300)))
        return await asyncio.gather(*running, long)

    await _with_loop(batcher, scenario())
    sizes = [size for size, _ in client.seen]
    assert len(set(sizes)) >= 2, "the riding batch shrank while chunks were running"
    assert all(gauge == size for size, gauge in client.seen), client.seen
    _assert_all_freed(allocator, client)


def _gauge(batcher, name: str) -> float:
    for line in batcher.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


@pytest.mark.parametrize("tokens_per_decode", [1, 4])
async def test_a_waiting_request_joins_after_max_waiting_tokens_tokens_not_steps(
        tokens_per_decode):
    """TGI counts the wait in tokens: with speculation a step passes several per request."""
    client = FakeShardClient(step_delay=0.02)
    client.tokens_per_decode = tokens_per_decode
    # a lone newcomer never brings 2x the running batch: it waits out max_waiting_tokens
    batcher, infer, allocator = _setup(client, ratio=2.0, max_waiting_tokens=12)

    async def scenario():
        first = asyncio.create_task(infer.generate(_request(max_new_tokens=60)))
        while not any(name == "decode" for name, _ in client.calls):
            await asyncio.sleep(0.001)  # the first is prefilled and its decode steps began
        second = await infer.generate(_request(max_new_tokens=2))
        await first
        return second

    await _with_loop(batcher, scenario())
    prefills = [i for i, (name, _) in enumerate(client.calls) if name == "prefill"]
    steps_waited = sum(1 for name, _ in client.calls[prefills[0]:prefills[1]] if name == "decode")
    assert steps_waited == -(-12 // tokens_per_decode)
    _assert_all_freed(allocator, client)


async def test_several_decode_steps_a_call_while_nothing_waits():
    """--max-decode-steps-per-call: once a step's cost is known and nothing waits, a call takes
    as many steps as fit in 50 ms (the fake's steps: ~5 ms); every token still reaches its stream
    in order, and a request finishing mid-call ends the call."""
    client = FakeShardClient(step_delay=0.005)
    batcher, infer, allocator = _setup(client, max_decode_steps=4)

    async def streamed(max_new_tokens):
        return [event.token.id async for event in infer.stream(_request(max_new_tokens))]

    tokens = await _with_loop(batcher, asyncio.gather(streamed(6), streamed(20)))
    assert tokens == [list(range(1, 7)), list(range(1, 21))]
    assert client.decode_steps_asked[0] == 1, "no step measured yet: one"
    assert max(client.decode_steps_asked) > 1
    assert len(client.decode_steps_asked) < 19, "fewer calls than steps"
    _assert_all_freed(allocator, client)


@pytest.mark.parametrize("stream_decode_steps", [True, False])
async def test_a_calls_steps_reach_their_streams_as_each_ends_where_streamed(stream_decode_steps):
    """Several steps a call: with stream_decode_steps (shards on CUDA) each token streams as its
    step ends (DecodeStream), the gaps between a stream's tokens a step's; without (the CPU),
    a call's tokens come together as it ends."""
    class Recording(FakeShardClient):
        async def decode(self, batches, max_steps=1, on_step=None):
            result = await super().decode(batches, max_steps, on_step)
            self.last_steps = result.steps
            return result

    client = Recording(step_delay=0.01)
    batcher, infer, allocator = _setup(client, max_decode_steps=4,
                                       stream_decode_steps=stream_decode_steps)

    async def arrivals():
        loop = asyncio.get_running_loop()
        return [loop.time() async for _ in infer.stream(_request(16))]

    times = await _with_loop(batcher, arrivals())
    assert max(client.decode_steps_asked) > 1, "calls took several steps"
    gaps = [b - a for a, b in zip(times[4:], times[5:])]  # past the first, single-step calls
    if stream_decode_steps:
        assert min(gaps) > 0.005, f"tokens came in bursts: gaps {gaps}"
    else:
        assert sum(g < 0.001 for g in gaps) >= len(gaps) // 2, f"no bursts: gaps {gaps}"
    # the tokens a request got from the last call, handed over or not (max_waiting_tokens)
    assert batcher.steps.last_step_tokens == client.last_steps
    _assert_all_freed(allocator, client)


async def test_one_decode_step_a_call_while_a_request_waits():
    """A request that cannot join yet (no KV room) keeps every call to one step, so it waits no
    longer than one step past the moment room comes."""
    client = FakeShardClient(step_delay=0.002)
    batcher, infer, allocator = _setup(client, num_blocks=14, max_decode_steps=4)

    async def scenario():
        first = asyncio.create_task(infer.generate(_request(max_new_tokens=40)))  # 12 blocks
        await wait_until_async(lambda: max(client.decode_steps_asked, default=0) > 1,
                               "the first request's decode calls to take several steps")
        second = asyncio.create_task(infer.generate(_request(max_new_tokens=3)))  # 3 more
        while not len(batcher.queue):
            await asyncio.sleep(0)
        arrived = len(client.calls)  # the call under way may have more steps; the next may not
        return arrived, await asyncio.gather(first, second)

    arrived, results = await _with_loop(batcher, scenario())
    assert [r.final.generated_tokens for r in results] == [40, 3]
    steps = iter(client.decode_steps_asked)
    asked = [(i, next(steps)) for i, (name, _) in enumerate(client.calls) if name == "decode"]
    second_prefill = max(i for i, (name, _) in enumerate(client.calls) if name == "prefill")
    before = [n for i, n in asked if i < arrived]
    while_waiting = [n for i, n in asked if arrived <= i < second_prefill]
    assert max(before) > 1
    assert while_waiting and set(while_waiting) == {1}
    _assert_all_freed(allocator, client)


async def test_a_batch_that_grew_is_timed_before_it_takes_several_steps_a_call():
    """Steps sized from the lone stream's cost would make the grown batch's calls overrun the
    50 ms budget: the first call after a join takes one step, and then the batch's own cost
    sizes them (here 48 ms a step: one)."""
    class RowCost(FakeShardClient):  # a step costs 3 ms per row
        async def decode(self, batches, max_steps=1, on_step=None):
            rows = sum(len(b.request_ids) for b in batches)
            result = await super().decode(batches, max_steps, on_step)
            await asyncio.sleep(0.003 * rows * result.steps)
            self.sized.append((rows, result.steps))
            return result

    client = RowCost()
    client.sized = []
    batcher, infer, allocator = _setup(client, max_decode_steps=4)

    async def scenario():
        first = asyncio.create_task(infer.generate(_request(max_new_tokens=60)))
        # the lone stream's steps are timed (3 ms): its calls take several
        await wait_until_async(lambda: any(rows == 1 and steps > 1 for rows, steps in client.sized),
                               "the lone stream's decode calls to take several steps")
        rest = [asyncio.create_task(infer.generate(_request(max_new_tokens=30)))
                for _ in range(15)]
        await asyncio.gather(first, *rest)

    await _with_loop(batcher, scenario())
    assert max(steps for rows, steps in client.sized if rows == 1) == 4
    assert {steps for rows, steps in client.sized if rows == 16} == {1}
    _assert_all_freed(allocator, client)
