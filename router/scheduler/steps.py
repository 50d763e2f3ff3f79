"""One shard step and its aftermath: the call, timed and counted as TGI counts them (tgi_batch_*)
and traced when tracing is on; its events handed to their requests; the finished and cancelled
requests dropped from the shards' batch; and, when it fails, the failure fanned out to the
requests it carried (or, when the shard group itself is gone, handed to recovery)."""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry.trace import Link, SpanKind

from proto.tracing import tracer, tracing_enabled
from router.errors import GenerationError, RouterError
from router.scheduler.active_request import ActiveRequest, deliver
from router.scheduler.chunk_sizing import DecodeCost
from router.scheduler.failures import FailureFanOut
from router.scheduler.running_requests import RunningRequests
from router.shards.client import ShardError
from router.shards.step_types import CachedBatch, Generation, NewBatch, StepResult
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router.steps")
_TRACER = tracer("tgi.router")


# prefill's answer when no request of the batch could be sent: no step ran, `running` is as it was
NOTHING_SENT = StepResult()


class ShardSteps:
    def __init__(self, client, metrics: Metrics, running: RunningRequests,
                 failures: FailureFanOut, *, stream_steps: bool = False):
        self.client = client
        self.stream_steps = stream_steps  # see SchedulingLimits.stream_decode_steps
        self.metrics = metrics
        self.running = running
        self.failures = failures
        self.decode_cost = DecodeCost()
        self.last_step_s: float | None = None  # a step of the last decode call, unsmoothed
        self.last_step_tokens = 1  # most tokens one request got from the last decode step
        # set by the batcher when a lost group can come back: whether the group is gone (the
        # same question the idle probe asks), and what to do then (fail or re-queue everything,
        # wait for the restart)
        self.is_lost: Callable[[], Awaitable[bool]] | None = None
        self.lose_shards: Callable[[RouterError], Awaitable[None]] | None = None

    def requests_in(self, batches: list[CachedBatch]) -> list[ActiveRequest]:
        return self.running.of(rid for b in batches for rid in b.request_ids)

    async def prefill(self, batch: NewBatch, items: list[ActiveRequest],
                      running: CachedBatch | None) -> StepResult | None:
        """One Prefill of `items`, with `running` taking its decode step in the same forward. On
        failure the new requests and the riding batch fail together (the shard dropped both) and
        None is returned. A request that cannot be put into a message, or that the shards refuse,
        fails alone; when none is left to send, nothing is and NOTHING_SENT is returned."""
        prepared, untranslatable = self.client.prepare(batch)
        for rejection in untranslatable:
            self.failures.rejected(rejection)
        if not prepared.request_ids:
            return NOTHING_SENT
        items = [i for i in items if not i.is_done]
        riding = [running] if running is not None else []

        def all_items() -> list[ActiveRequest]:
            return items + self.requests_in(riding)

        result = await self._timed("prefill", self.client.prefill(prepared, running), all_items)
        if isinstance(result, ShardError):
            await self._fail(all_items(), [batch.id] + [b.id for b in riding], result)
            return None
        for rejection in result.rejected:
            self.failures.rejected(rejection)
        return result

    async def decode(self, batches: list[CachedBatch], max_steps: int = 1) -> CachedBatch | None:
        """A call of up to max_steps steps; with stream_steps each step's tokens reach their
        requests as the step ends, else all of them when the call does."""
        handed = []  # the steps handed over before the call's end (a token each per request)

        def on_step(step: StepResult) -> None:
            handed.append(step)
            self._deliver(step.generations)

        call = self.client.decode(batches, max_steps, on_step if self.stream_steps else None)
        result = await self._timed("decode", call, lambda: self.requests_in(batches))
        if isinstance(result, ShardError):
            await self._fail(self.requests_in(batches), [b.id for b in batches], result)
            return None
        if result.draft_tokens:
            self.metrics.observe_speculation(result.draft_tokens, result.accepted_tokens)
        # at least one: a step whose every generation failed to be read still passed a token
        self.last_step_tokens = len(handed) + max([1, *(len(g.events)
                                                        for g in result.generations)])
        return await self.after_step(result, "decode")

    async def after_step(self, result: StepResult, method: str) -> CachedBatch | None:
        """Delivers the step's events and returns what is left running of its batch."""
        started = time.monotonic()
        try:
            return await self._deliver_and_filter(result)
        finally:
            self.metrics.batch_filter_duration.labels(method).observe(time.monotonic() - started)
            self.running.update_gauges()

    def _deliver(self, generations: list[Generation]) -> None:
        for generation in generations:
            item = self.running.get(generation.request_id)
            if item is None or not item.is_live:
                continue
            if generation.error is not None:
                # done now: the filter after the call drops it from the shards, freeing its blocks
                self.failures.generation_failed(item, generation.error)
            else:
                for event in generation.events:
                    deliver(item, event)

    async def _deliver_and_filter(self, result: StepResult) -> CachedBatch | None:
        self._deliver(result.generations)
        if result.batch is None:
            for generation in result.generations:
                self.running.release(generation.request_id)
            return None
        return await self._filter(result.batch)

    async def _filter(self, batch: CachedBatch) -> CachedBatch | None:
        """Drops finished and cancelled requests from the shards' batch and frees their blocks."""
        live = []
        for rid in batch.request_ids:
            item = self.running.get(rid)
            if item is None or not item.is_live:
                self.running.release(rid)
            else:
                live.append(rid)
        try:
            if not live:
                await self.client.clear_cache(batch.id)
                return None
            if len(live) == len(batch.request_ids):
                return batch
            return await self.client.filter_batch(batch.id, live)
        except ShardError as err:
            await self._fail(self.running.of(live), [batch.id], err)
            return None

    async def _fail(self, items: list[ActiveRequest], batch_ids: list[int], err: Exception) -> None:
        log.error("shard step failed for %d requests: %s", len(items), err)
        error = err if isinstance(err, RouterError) else GenerationError(str(err))
        if self.is_lost is not None and await self.is_lost():
            await self.lose_shards(error)
            return
        self.failures.fail(items, error)
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError as clear_err:
                log.error("could not clear batch %d: %s", batch_id, clear_err)

    async def _timed(self, method: str, call: Awaitable[StepResult],
                     riders: Callable[[], list[ActiveRequest]]) -> StepResult | ShardError:
        """Awaits one step ("prefill" or "decode"); a ShardError is returned, not raised.
        `riders` lists the requests in the step (asked only when tracing)."""
        metrics = self.metrics
        metrics.counters.inc("tgi_batch_inference_count", method=method)
        started = time.monotonic()
        try:
            if tracing_enabled():
                # one span per step, linked to every request riding in it; the shards' spans
                # become its children through the gRPC metadata
                links = [Link(i.span_context) for i in riders() if i.span_context is not None]
                with _TRACER.start_as_current_span(method, kind=SpanKind.CLIENT, links=links):
                    result = await call
            else:
                result = await call
        except ShardError as err:
            metrics.counters.inc("tgi_batch_inference_failure", method=method)
            return err
        elapsed = time.monotonic() - started
        # a call of several decode steps counts as that many inferences of its mean duration, as
        # TGI's metrics count steps
        steps = result.steps
        metrics.counters.inc("tgi_batch_inference_success", steps, method=method)
        if steps > 1:
            metrics.counters.inc("tgi_batch_inference_count", steps - 1, method=method)
        if method == "decode":
            self.last_step_s = elapsed / steps
            self.decode_cost.observe(self.last_step_s)
            log.debug("decode call: %d steps, %.3f s", steps, elapsed)
        timings = result.timings
        for _ in range(steps):
            metrics.batch_inference_duration.labels(method).observe(elapsed / steps)
            metrics.batch_forward_duration.labels(method).observe(timings.forward_ns / 1e9 / steps)
            metrics.batch_decode_duration.labels(method).observe(timings.decode_ns / 1e9 / steps)
        if timings.concat_ns is not None:
            metrics.batch_concat_duration.labels(method).observe(timings.concat_ns / 1e9)
        return result
