"""One shard step and its aftermath, answered as a StepOutcome.

The call is timed and counted as TGI counts them (tgi_batch_*) and traced when tracing is on; its
events are handed to their requests; the finished and cancelled requests are dropped from the
shards' batch. When it fails, the failure reaches the requests it carried (Failed), unless the shard
group itself is gone (ShardsLost: the batcher hands the requests to recovery).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill ran; its events wait for after_step (the batcher first remembers its prompts)."""

    result: StepResult


@dataclass(frozen=True, slots=True)
class Ran:
    """A step ran and its events were handed out; `running` is what is left of its batch."""

    running: CachedBatch | None


@dataclass(frozen=True, slots=True)
class NothingSent:
    """No request of a prefill could be sent: no step ran, the running batch is as it was."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The step failed: its requests heard `error`, and the shards' batches were cleared."""

    error: RouterError


@dataclass(frozen=True, slots=True)
class ShardsLost:
    """The shard group is gone with every batch; its requests are left to the batcher's recovery."""

    error: RouterError


NOTHING_SENT = NothingSent()
# prefill answers Prefilled, NothingSent, Failed or ShardsLost; decode and after_step answer Ran,
# Failed or ShardsLost
StepOutcome = Prefilled | Ran | NothingSent | Failed | ShardsLost
IsLost = Callable[[], Awaitable[bool]]


class ShardSteps:
    """Runs prefill and decode steps on the shards and answers each with a StepOutcome."""

    def __init__(self, client, metrics: Metrics, running: RunningRequests,
                 failures: FailureFanOut, *, is_lost: IsLost | None = None,
                 stream_steps: bool = False):
        self.client = client
        self.stream_steps = stream_steps  # see SchedulingLimits.stream_decode_steps
        self.metrics = metrics
        self.running = running
        self.failures = failures
        self.decode_cost = DecodeCost()
        # a decode step as the shards computed it (forward and sampling), without the time its
        # call waited behind other calls on the shard's engine thread (Embed calls among them),
        # which would otherwise count as the step's own and size those calls ever larger
        self.shard_step_cost = DecodeCost()
        self.decode_calls = 0  # decode calls answered: an Embed call waits for the next one
        self.last_step_s: float | None = None  # a step of the last decode call, unsmoothed
        self.last_step_tokens = 1  # most tokens one request got from the last decode step
        # whether the shard group is gone (recovery's question, asked after a failed step); None
        # when a lost group never comes back: its requests simply fail
        self.is_lost = is_lost

    def requests_in(self, batches: list[CachedBatch]) -> list[ActiveRequest]:
        return self.running.of(rid for b in batches for rid in b.request_ids)

    async def prefill(self, batch: NewBatch, items: list[ActiveRequest],
                      running: CachedBatch | None
                      ) -> Prefilled | NothingSent | Failed | ShardsLost:
        """One Prefill of `items`, with `running` taking its decode step in the same forward.

        On failure the new requests and the riding batch fail together (the shard dropped both).
        A request that cannot be put into a message, or that the shards refuse, fails alone; when
        none is left to send, nothing is (NothingSent).
        """
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
            return await self._fail(all_items(), [batch.id] + [b.id for b in riding], result)
        for rejection in result.rejected:
            self.failures.rejected(rejection)
        return Prefilled(result)

    async def decode(self, batches: list[CachedBatch], max_steps: int = 1
                     ) -> Ran | Failed | ShardsLost:
        """A call of up to max_steps steps.

        With stream_steps each step's tokens reach their requests as the step ends, else all of
        them when the call does.
        """
        handed = []  # the steps handed over before the call's end (a token each per request)

        def on_step(step: StepResult) -> None:
            handed.append(step)
            self._deliver(step.generations)

        call = self.client.decode(batches, max_steps, on_step if self.stream_steps else None)
        result = await self._timed("decode", call, lambda: self.requests_in(batches))
        if isinstance(result, ShardError):
            return await self._fail(self.requests_in(batches), [b.id for b in batches], result)
        if result.draft_tokens:
            self.metrics.observe_speculation(result.draft_tokens, result.accepted_tokens)
        # at least one: a step whose every generation failed to be read still passed a token
        self.last_step_tokens = len(handed) + max([1, *(len(g.events)
                                                        for g in result.generations)])
        return await self.after_step(result, "decode")

    async def after_step(self, result: StepResult, method: str) -> Ran | Failed | ShardsLost:
        """Delivers the step's events and drops what finished from the shards' batch."""
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
            elif item.is_behind:  # so is a request whose client stopped reading
                self.failures.reader_gone(item)
            else:
                for event in generation.events:
                    deliver(item, event)

    async def _deliver_and_filter(self, result: StepResult) -> Ran | Failed | ShardsLost:
        self._deliver(result.generations)
        if result.batch is None:
            for generation in result.generations:
                self.running.release(generation.request_id)
            return Ran(None)
        return await self._filter(result.batch)

    async def _filter(self, batch: CachedBatch) -> Ran | Failed | ShardsLost:
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
                return Ran(None)
            if len(live) == len(batch.request_ids):
                return Ran(batch)
            return Ran(await self.client.filter_batch(batch.id, live))
        except ShardError as err:
            return await self._fail(self.running.of(live), [batch.id], err)

    async def _fail(self, items: list[ActiveRequest], batch_ids: list[int], err: Exception
                    ) -> Failed | ShardsLost:
        """What a failed call means: the shard group is gone, or the step failed.

        Gone: nothing is failed here. Failed: `items` hear the error and the shards let go of
        `batch_ids`.
        """
        log.error("shard step failed for %d requests: %s", len(items), err)
        error = err if isinstance(err, RouterError) else GenerationError(str(err))
        if self.is_lost is not None and await self.is_lost():
            return ShardsLost(error)
        self.failures.fail(items, error)
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError as clear_err:
                log.error("could not clear batch %d: %s", batch_id, clear_err)
        return Failed(error)

    async def _timed(self, method: str, call: Awaitable[StepResult],
                     riders: Callable[[], list[ActiveRequest]]) -> StepResult | ShardError:
        """Awaits one step ("prefill" or "decode"); a ShardError is returned, not raised.

        `riders` lists the requests in the step (asked only when tracing).
        """
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
            self.shard_step_cost.observe((result.timings.forward_ns + result.timings.decode_ns)
                                         / 1e9 / steps)
            self.decode_calls += 1
            log.debug("decode call: %d steps, %.3f s", steps, elapsed)
        timings = result.timings
        for _ in range(steps):
            metrics.batch_inference_duration.labels(method).observe(elapsed / steps)
            metrics.batch_forward_duration.labels(method).observe(timings.forward_ns / 1e9 / steps)
            metrics.batch_decode_duration.labels(method).observe(timings.decode_ns / 1e9 / steps)
        if timings.concat_ns is not None:
            metrics.batch_concat_duration.labels(method).observe(timings.concat_ns / 1e9)
        return result


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """What the prefill between two decode steps did, when it did not lose the shards."""

    ran: bool  # a prefill ran (a new batch, or a long prompt's chunk)
    batch: CachedBatch | None = None  # the batch it left
    # `batch` is the running batch after its decode step, taken in the prefill's forward
    is_running: bool = False


NO_PREFILL = PrefillStep(ran=False)


def left_running(outcome: StepOutcome, running: CachedBatch | None
                  ) -> CachedBatch | None | ShardsLost:
    """What is left running after a step's outcome.

    The batch a step that ran left; `running` when nothing was sent; nothing when the step failed
    (the shards dropped it); a loss is passed on."""
    match outcome:
        case Ran(batch):
            return batch
        case NothingSent():
            return running
        case Failed():
            return None
        case ShardsLost():
            return outcome
    raise AssertionError(f"a prefill's result must go through after_step: {outcome!r}")


def prefill_step(left: CachedBatch | None | ShardsLost, running: CachedBatch | None
                  ) -> PrefillStep | ShardsLost:
    """A prefill that ran, leaving `left`; it is the running batch when one rode along."""
    if isinstance(left, ShardsLost):
        return left
    return PrefillStep(ran=True, batch=left, is_running=running is not None)
