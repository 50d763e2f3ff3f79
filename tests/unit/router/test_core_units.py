"""The scheduler's units on their own: the running requests' blocks, the failure fan-out, the
scheduling policy's numbers, and the one SSE driver every streaming route runs."""
import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.errors import GenerationError, IncompleteGenerationError, RouterError
from router.api.tgi.errors import tgi_error_body
from router.http.middleware import ErrorBodies, error_middleware
from router.http.sse import WRITE_TIMEOUT, StreamFormat, serve_stream
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.prefix_cache import PrefixCache
from router.scheduler.active_request import ActiveRequest, deliver
from router.scheduler.failures import FailureFanOut
from router.scheduler.policy import ChunkedPrefill, SchedulingLimits
from router.scheduler.request_queue import RequestQueue
from router.scheduler.running_requests import RunningRequests
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Token, TokenEvent)
from router.shards.step_types import Rejection
from router.telemetry.metrics import Metrics


def _setup(prefix=False):
    pool = BlockPool(40, 4)
    cache = PrefixCache(pool) if prefix else None
    allocator = BlockAllocator(pool, [cache.evict] if cache is not None else [])
    metrics = Metrics(max_input_tokens=100, max_total_tokens=200)
    queue = RequestQueue(allocator, cache)
    running = RunningRequests(allocator, cache, metrics)
    return allocator, queue, running, FailureFanOut(running, queue, metrics)


def _item(rid, allocator=None, length=8, max_new=4):
    ids = list(range(100 + rid, 100 + rid + length))
    item = ActiveRequest(id=rid, input_length=length, max_new_tokens=max_new, prompt_ids=ids,
                         request=GenerateRequest("x", ids, SamplingParams(),
                                                 StoppingParams(max_new_tokens=max_new)))
    if allocator is not None:
        item.allocation = allocator.allocate(item.kv_tokens)
    return item


def _drain(item):
    events = []
    while not item.events.empty():
        events.append(item.events.get_nowait())
    return events


def test_a_released_request_frees_its_blocks_once():
    allocator, _, running, _ = _setup()
    item = _item(0, allocator)
    running.start([item])
    assert item.attempts == 1 and running.get(0) is item
    running.release(0)
    running.release(0)
    assert item.is_done and allocator.num_free_blocks == allocator.num_usable_blocks


def test_a_computed_prompt_joins_the_prefix_cache_and_a_reset_forgets_it():
    allocator, _, running, _ = _setup(prefix=True)
    item = _item(0, allocator)
    running.start([item])
    running.remember_prompts([item])
    assert len(running.prefix_cache) == 2, "two full blocks of 4 in an 8-token prompt"
    running.release(0)
    running.reset_pool(20)
    assert len(running.prefix_cache) == 0 and allocator.num_free_blocks == 19


def test_a_rejected_request_fails_alone_and_frees_its_blocks():
    allocator, _, running, failures = _setup()
    kept, refused = _item(0, allocator), _item(1, allocator)
    running.start([kept, refused])
    failures.rejected(Rejection(1, "no grammar for this vocabulary"))
    (error,) = _drain(refused)
    assert isinstance(error, GenerationError) and "no grammar" in str(error)
    assert refused.is_done and running.get(1) is None and running.get(0) is kept
    assert _drain(kept) == []


def test_a_failure_reaches_a_request_that_already_ended_not_at_all():
    allocator, _, running, failures = _setup()
    done, live = _item(0, allocator), _item(1, allocator)
    running.start([done, live])
    deliver(done, TokenEvent(Token(1, "a", None),
                             final=FinalInfo("a", 1, FinishReason.LENGTH, None)))
    failures.fail_running(GenerationError("boom"))
    assert [type(e) for e in _drain(done)] == [TokenEvent]
    assert [type(e) for e in _drain(live)] == [GenerationError]
    assert allocator.num_free_blocks == allocator.num_usable_blocks


def test_lost_shards_send_back_only_requests_that_received_nothing_within_their_attempts():
    allocator, queue, running, failures = _setup()
    fresh, streaming, retried = _item(0, allocator), _item(1, allocator), _item(2, allocator)
    retried.attempts = 1  # sent back once already: start() makes it 2
    running.start([fresh, streaming, retried])
    deliver(streaming, TokenEvent(Token(1, "a", None)))
    failures.shards_lost(GenerationError("gone"), max_attempts=2, may_retry=True)
    assert queue.entries() == [fresh] and fresh.allocation is None and not fresh.is_done
    assert [type(e) for e in _drain(streaming)] == [TokenEvent, GenerationError]
    assert [type(e) for e in _drain(retried)] == [GenerationError]
    assert len(running) == 0 and allocator.num_free_blocks == allocator.num_usable_blocks


def test_lost_shards_while_stopping_send_nothing_back():
    allocator, queue, running, failures = _setup()
    item = _item(0, allocator)
    running.start([item])
    failures.shards_lost(GenerationError("gone"), max_attempts=2, may_retry=False)
    assert queue.entries() == [] and [type(e) for e in _drain(item)] == [GenerationError]


def test_join_bounds_follow_waiting_served_ratio_and_max_batch_size():
    limits = SchedulingLimits(64, 1000, waiting_served_ratio=0.5, max_waiting_tokens=3,
                              max_batch_size=10)
    assert limits.join_bounds(0, 0) == (None, 10)
    assert limits.join_bounds(6, 0) == (3, 4), "half the running batch, up to the cap"
    assert limits.join_bounds(6, 3) == (None, 4), "waited long enough: any number joins"
    assert limits.join_reason(1) == "backpressure" and limits.join_reason(3) == "wait_exceeded"
    # shards that chunk: no minimum, the cap still holds, every join labelled as TGI does
    assert limits.join_bounds(6, 0, chunking=True) == (None, 4)
    assert limits.join_reason(1, chunking=True) == "chunking"


def test_the_join_rule_counts_as_set_only_when_a_flag_leaves_its_default():
    from router.config.model import ModelSettings
    assert not ModelSettings(tokenizer_path="/m").sets_join_rule()
    assert ModelSettings(tokenizer_path="/m", waiting_served_ratio=1.2).sets_join_rule()
    assert ModelSettings(tokenizer_path="/m", max_waiting_tokens=5).sets_join_rule()


def test_a_chunked_prefill_advances_to_its_last_chunk():
    chunk = ChunkedPrefill(_item(0, length=300), next_start=0)
    size = chunk.next_size(budget=128, decode_s=None)
    assert 0 < size <= 128 and not chunk.is_last(size)
    chunk.advance(size, elapsed=0.5, decode_s=0.1)
    assert chunk.next_start == size and chunk.s_per_token == (0.5 - 0.1) / size
    chunk.next_start = 290
    assert chunk.is_last(chunk.next_size(budget=128, decode_s=0.1))


def test_a_chunk_that_added_more_than_a_step_waits_for_the_steps_to_average_out():
    chunk = ChunkedPrefill(_item(0, length=300), next_start=0)
    chunk.advance(16, elapsed=0.045, decode_s=0.012, now=100.0)  # added 0.033: 2.75 steps
    assert chunk.not_before == pytest.approx(100.054)  # 0.033 / STALL_RATIO - 0.012
    assert not chunk.due(100.053) and chunk.due(100.0541)
    chunk.advance(16, elapsed=0.016, decode_s=0.012, now=200.0)  # under its share: no wait
    assert chunk.due(200.0)
    chunk.advance(16, elapsed=0.9, decode_s=None, now=300.0)  # nothing decoding: never waits
    assert chunk.due(200.0)


def test_beside_more_streams_a_chunk_waits_for_a_smaller_share():
    """Beside two streams the prompt takes a fifth of the machine: the wait doubles."""
    chunk = ChunkedPrefill(_item(0, length=300), next_start=0)
    chunk.next_size(budget=128, decode_s=0.012, decoding_rows=2)
    chunk.advance(16, elapsed=0.045, decode_s=0.012, now=100.0)  # added 0.033
    assert chunk.not_before == pytest.approx(100.0 + 0.033 / 0.25 - 0.012)


class _Lines(StreamFormat):
    def event(self, index, event):
        return [f"{index}:{event.token.text}\n".encode()]

    def error(self, err: RouterError) -> bytes:
        return f"error:{err}\n".encode()

    def done(self):
        return [b"done\n"]


async def _serve(events_factory, streams=1):
    async def handler(request):
        return await serve_stream(request, events_factory(), _Lines(), streams=streams)

    app = web.Application(middlewares=[error_middleware(ErrorBodies(tgi_error_body))])
    app[WRITE_TIMEOUT] = 30.0
    app.router.add_get("/", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        reply = await client.get("/")
        return reply.status, await reply.text()
    finally:
        await client.close()


async def test_the_driver_writes_events_then_done_and_closes_the_source():
    closed = asyncio.Event()

    async def events():
        try:
            yield 0, TokenEvent(Token(1, "a", None))
            yield 0, TokenEvent(Token(2, "b", None),
                                final=FinalInfo("ab", 2, FinishReason.LENGTH, None))
        finally:
            closed.set()

    assert await _serve(events) == (200, "0:a\n0:b\ndone\n")
    assert closed.is_set()


async def test_the_driver_answers_an_early_error_with_its_status():
    async def events():
        raise GenerationError("no shard")
        yield

    status, _ = await _serve(events)
    assert status == 424


async def test_the_driver_ends_a_stream_without_its_final_event_with_an_error_frame():
    async def events():
        yield 0, TokenEvent(Token(1, "a", None))

    status, text = await _serve(events)
    assert status == 200
    incomplete = IncompleteGenerationError("Incomplete generation stream")
    assert text == f"0:a\nerror:{incomplete}\ndone\n"


async def test_the_driver_turns_an_unexpected_error_into_the_formats_error_frame():
    async def events():
        yield 0, TokenEvent(Token(1, "a", None))
        raise RuntimeError("a bug")

    status, text = await _serve(events)
    assert status == 200
    assert text.startswith("0:a\nerror:") and "RuntimeError: a bug" in text
    assert text.endswith("done\n")


def test_decode_steps_a_call_fit_the_calls_time_and_only_while_nothing_waits():
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=1000,
                              waiting_served_ratio=0.3, max_waiting_tokens=20,
                              max_batch_size=None, max_decode_steps=4)
    assert limits.decode_steps(None, waiting=False) == 1  # no step measured yet
    assert limits.decode_steps(0.005, waiting=False) == 4  # 50 ms / 5 ms, capped at 4
    assert limits.decode_steps(0.020, waiting=False) == 2
    assert limits.decode_steps(0.040, waiting=False) == 1
    assert limits.decode_steps(0.005, waiting=True) == 1
    limits.max_decode_steps = 1
    assert limits.decode_steps(0.005, waiting=False) == 1
