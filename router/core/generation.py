"""The generation core every API module calls: admission, event streams, fan-out, request metrics.

Admission answers 429 past the concurrency limit; one request's event stream is cancelled on exit; n
requests fan out (merged streams, each abortable alone, or all results, the others cancelled when
one fails); the request-level metrics are those every API shares.

An API module turns its wire format into GenerateRequests and these events into its wire format; it
never sees the queue, the shards or the KV blocks.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TypeVar

from router.core.adapter_use import AdapterUse
from router.errors import (IncompleteGenerationError, NotServedError, OverloadedError,
                           RouterError, SlowReaderError, ValidationError)
from router.inputs.seeds import copies
from router.scheduler.active_request import ActiveRequest
from router.scheduler.batcher import Batcher
from router.scheduler.request_queue import HeldPrefix
from router.schemas import FinalInfo, FinishReason, GenerateRequest, Timings, Token, TokenEvent
from router.telemetry.metrics import Metrics
from router.telemetry.request_record import current_record
from router.telemetry.tracing import current_span_context


@dataclass(slots=True)
class GenerateResult:
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[Token] = field(default_factory=list)
    prefill_top_tokens: list[list[Token]] | None = None  # per prompt position, when asked
    final: FinalInfo | None = None
    timings: Timings = field(default_factory=Timings)

    @property
    def logprob_sum(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a request continues and where its result goes (a request_id session's)."""

    held_prefix: HeldPrefix | None  # blocks holding its prompt's start, read when it is planned
    # handed the final event's info while the request still holds its blocks
    on_final: Callable[[ActiveRequest, FinalInfo], None]


T = TypeVar("T")


@dataclass(eq=False)
class FanOutStream:
    """One stream of a fan-out (Infer.stream_many); `abort()` ends it alone, the others go on.

    It then ends with an event of its own whose final holds what it had generated (reason:
    length).
    """

    timings: Timings | None = None  # its own; a copy of the fan-out's when None
    aborted: bool = False
    finished: bool = False  # its final event arrived
    task: asyncio.Task | None = None

    def abort(self) -> None:
        if not self.finished and not self.aborted:
            self.aborted = True
            if self.task is not None:
                self.task.cancel()

_FAILURE_LABELS = {"validation": "validation", "overloaded": "overloaded",
                   "generation": "generation", "incomplete_generation": "incomplete"}

# Events a stream's reader may leave unread from one decode call to the next (a call delivers up
# to --max-decode-steps-per-call steps at once): one that falls further behind stopped reading,
# and its request ends (SlowReaderError) rather than pile its events up in the router. A reader
# that keeps up takes each call's events while the shards compute the next.
MAX_UNREAD_EVENTS = 256


class Infer:
    def __init__(self, batcher: Batcher, metrics: Metrics, *, max_concurrent_requests: int,
                 grammar_support: bool = True, max_unread_events: int = MAX_UNREAD_EVENTS,
                 generates: bool = True):
        self.batcher = batcher
        self.generates = generates  # False: an encoder, whose every generation is refused
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        # False (--disable-grammar-support): constrained requests are refused, as TGI refuses them
        self.grammar_support = grammar_support
        self.max_unread_events = max_unread_events
        # every request whose stream is open, by id; those whose generation goes on hold a slot
        self._admitted: dict[int, ActiveRequest] = {}
        self.validating = 0  # requests being read and checked, before they are admitted
        # the LoRA adapters requests may name, and each one's requests in flight
        self.adapters = AdapterUse()
        self._ids = itertools.count()

    @property
    def in_flight(self) -> int:
        """Requests whose generation goes on: each holds one of --max-concurrent-requests.

        A request lets go of its slot when its generation ends (its last event is delivered, it
        failed, it was cancelled), not when its reader has taken every event: a client that
        reads slowly, or not at all, holds no slot once the shards are done with its request.
        """
        return sum(not item.is_done for item in self._admitted.values())

    def record_failure(self, error: RouterError) -> None:
        self.metrics.counters.inc("tgi_request_failure",
                                  err=_FAILURE_LABELS.get(error.error_type, error.error_type))

    async def count_request(self, validation: Awaitable[T]) -> T:
        """Counts a request and, when its validation fails, the failure, as TGI does."""
        self.metrics.counters.inc("tgi_request_count")
        self.validating += 1
        try:
            return await validation
        except RouterError as err:
            self.record_failure(err)
            raise
        finally:
            self.validating -= 1

    @property
    def is_idle(self) -> bool:
        """Whether no request is being validated, generated or written (what a drain waits for)."""
        return not self._admitted and self.validating == 0

    def _admit(self, request: GenerateRequest, continuation: Continuation | None
               ) -> ActiveRequest:
        if not self.generates:
            raise NotServedError("this model only embeds: it generates no text (use "
                                 "/v1/embeddings, /embed or /api/embed)")
        if request.grammar is not None and not self.grammar_support:
            raise ValidationError("grammar is not supported")  # TGI's words
        if self.in_flight >= self.max_concurrent_requests:
            raise OverloadedError()
        # validated against the loaded adapters already; one being unloaded since is refused
        self.adapters.check(request.adapter_id)
        allocator = self.batcher.allocator
        beams = request.num_beams > 1  # a row of KV per beam, each rounded up to whole blocks
        item = ActiveRequest(id=next(self._ids), input_length=request.input_length,
                             max_new_tokens=request.stopping.max_new_tokens,
                             prompt_ids=None if request.computes_whole_prompt
                             else request.input_ids,
                             adapter_id=request.adapter_id, request=request,
                             prompt_images=request.images,
                             span_context=current_span_context(),
                             held_prefix=continuation and continuation.held_prefix,
                             on_final=continuation and continuation.on_final,
                             kv_rows=request.num_beams if beams else 1,
                             kv_row_slack=allocator.block_size if beams else 0,
                             max_unread_events=self.max_unread_events)
        if allocator.blocks_needed(item.kv_tokens) > allocator.num_usable_blocks:
            raise ValidationError(f"the request needs {item.kv_tokens} tokens of KV cache but the "
                                  f"server holds {allocator.num_usable_blocks * allocator.block_size}")
        return item

    async def stream(self, request: GenerateRequest, timings: Timings | None = None, *,
                     continuation: Continuation | None = None) -> AsyncIterator[TokenEvent]:
        """Events of one request; leaving the iteration early cancels it and frees what it held.

        With `continuation`, the request continues a request_id session, which keeps the result.
        """
        timings = timings or Timings(started_at=time.monotonic())
        try:
            item = self._admit(request, continuation)
        except RouterError as err:
            self.record_failure(err)
            raise
        record = current_record()  # the HTTP request's access-log record
        if record is not None:
            record.generation_started(request.input_ids, request.input_length,
                                      request.adapter_id)
        metrics = self.metrics
        metrics.input_length.observe(request.input_length)
        metrics.max_new_tokens.observe(request.stopping.max_new_tokens)
        if request.adapter_id is not None:
            metrics.counters.inc("tgi_request_adapter_count", adapter=request.adapter_id)
        self.adapters.enter(request.adapter_id)
        self._admitted[item.id] = item
        timings.queued_at = time.monotonic()
        metrics.validation_duration.observe(timings.queued_at - timings.started_at)
        try:
            self.batcher.submit(item)
            while True:
                event = await item.events.get()
                if isinstance(event, RouterError):
                    if not isinstance(event, SlowReaderError):  # counted as it was ended
                        self.record_failure(event)
                    raise event
                if timings.batched_at == 0.0:
                    timings.batched_at = item.batched_at
                    timings.cached_tokens = item.cache_len
                yield event
                if event.final is not None:
                    self._record_success(timings, event.final)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not item.is_done:
                metrics.counters.inc("tgi_request_failure", err="dropped")
            raise
        finally:
            if not item.is_done:
                self.batcher.cancel(item)
            del self._admitted[item.id]
            self.adapters.leave(request.adapter_id)
            if record is not None:  # what the shards generated (a beam's final list whole)
                record.generated_tokens += len(item.generated_ids)

    def _record_success(self, timings: Timings, final: FinalInfo) -> None:
        timings.finished_at = time.monotonic()
        metrics = self.metrics
        metrics.counters.inc("tgi_request_success")
        metrics.request_duration.observe(timings.finished_at - timings.started_at)
        metrics.queue_duration.observe(timings.batched_at - timings.queued_at)
        inference = timings.finished_at - timings.batched_at
        metrics.inference_duration.observe(inference)
        metrics.time_per_token.observe(inference / max(final.generated_tokens, 1))
        metrics.generated_tokens.observe(final.generated_tokens)

    async def generate(self, request: GenerateRequest, timings: Timings | None = None, *,
                       continuation: Continuation | None = None) -> GenerateResult:
        result = GenerateResult(timings=timings or Timings(started_at=time.monotonic()))
        async for event in self.stream(request, result.timings, continuation=continuation):
            result.tokens.append(event.token)
            result.top_tokens.append(event.top_tokens)
            if event.prefill is not None:
                result.prefill = event.prefill
            if event.prefill_top_tokens is not None:
                result.prefill_top_tokens = event.prefill_top_tokens
            if event.final is not None:
                result.final = event.final
        if result.final is None:
            error = IncompleteGenerationError()
            self.record_failure(error)
            raise error
        return result

    async def generate_many(self, requests: list[GenerateRequest],
                            timings: Timings | None = None, *,
                            continuations: list[Continuation] | None = None
                            ) -> list[GenerateResult]:
        """Every request's result, in order; when one fails the others are cancelled.

        A caller that goes away cancels them all; each frees what it held. `continuations`: one
        per request (see stream).
        """
        continuations = continuations or [None] * len(requests)
        tasks = [asyncio.ensure_future(self.generate(r, replace(timings) if timings else None,
                                                     continuation=c))
                 for r, c in zip(requests, continuations)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def stream_many(self, requests: list[GenerateRequest], timings: Timings | None = None,
                          *, streams: list[FanOutStream] | None = None,
                          on_event: Callable[[int, TokenEvent], None] | None = None
                          ) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(index of the request, event) from every request's stream as the events arrive.

        The first error is raised and leaving early cancels every stream. `streams`: one
        handle per request, to abort it alone; `on_event` sees each event as it arrives,
        before the reader does (who may lag several events behind).
        """
        if len(requests) == 1 and streams is None and on_event is None:
            # no tasks and no hop through a queue for the common case
            async with aclosing(self.stream(requests[0], timings)) as events:
                async for event in events:
                    yield 0, event
            return
        streams = streams or [FanOutStream() for _ in requests]
        merged: asyncio.Queue = asyncio.Queue()
        taken = asyncio.Event()  # set as the reader takes an event: a waiting pump looks again

        def arrived(index: int, event: TokenEvent) -> None:
            if on_event is not None:
                on_event(index, event)
            merged.put_nowait((index, event))

        async def pump(index: int, request: GenerateRequest, handle: FanOutStream) -> None:
            texts: list[str] = []
            try:
                if handle.aborted:
                    raise asyncio.CancelledError
                own = handle.timings or (replace(timings) if timings else None)
                # closed here, not when collected: a pump may be cancelled while it waits
                # outside the stream, and only closing it cancels the request
                async with aclosing(self.stream(request, own)) as events:
                    async for event in events:
                        texts.append(event.token.text)
                        handle.finished = event.final is not None
                        arrived(index, event)
                        # a pump runs at most the bound ahead of the reader: the events of a
                        # reader that stopped wait in their request's queue, where the
                        # scheduler sees them (ActiveRequest.is_behind)
                        while 0 < self.max_unread_events <= merged.qsize():
                            taken.clear()
                            await taken.wait()
            except asyncio.CancelledError:
                if not handle.aborted:
                    raise
                arrived(index, TokenEvent(Token(-1, "", None), final=FinalInfo(
                    "".join(texts), len(texts), FinishReason.LENGTH, None)))
            except Exception as err:  # raised to the reader, which fails the whole response
                merged.put_nowait((index, err))
            finally:
                merged.put_nowait((index, None))

        tasks = []
        for index, (request, handle) in enumerate(zip(requests, streams)):
            handle.task = asyncio.ensure_future(pump(index, request, handle))
            tasks.append(handle.task)
        try:
            open_streams = len(tasks)
            while open_streams:
                index, item = await merged.get()
                taken.set()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate_best_of(self, request: GenerateRequest, best_of: int, timings: Timings
                               ) -> tuple[GenerateResult, list[GenerateResult]]:
        """(the answer, the other sequences) of a request, sampled best_of times.

        With best_of > 1, that many sampled sequences with their own seeds (copies); the
        most likely (summed log-prob) wins.
        """
        if best_of == 1:
            return await self.generate(request, timings), []
        results = await self.generate_many(copies(request, best_of), timings)
        ranked = sorted(results, key=lambda r: r.logprob_sum, reverse=True)
        return ranked[0], ranked[1:]
