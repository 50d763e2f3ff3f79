"""The continuous-batching loop: prefill new requests, decode the running batch, filter what finished.

It is the only module that drives the shards. Between two decode steps it asks the queue for more work.
With shards that chunk, new requests are prefilled in the same forward as the running batch's next
step (TGI's cached_batch) and join it; otherwise in their own batch, merged at the next decode.
A prompt longer than the prefill budget (when the shards chunk) is computed a chunk at a time,
sized and spaced by decode steps so that it takes a bounded share beside the running streams
(router.scheduler.chunk_sizing); shorter prompts arriving meanwhile go between two chunks.

It decides what the next step is and speaks the router's types (router.shards.step_types). In
router.scheduler: policy holds the numbers; steps runs a step, delivers its events and filters what
finished; running_requests counts each request's blocks; failures fans out failures; recovery
waits out a lost shard group.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from router.errors import GenerationError, RouterError
from router.kv.block_allocator import BlockAllocator
from router.kv.sessions import SessionStore
from router.scheduler.active_request import ActiveRequest
from router.scheduler.failures import FailureFanOut
from router.scheduler.policy import ChunkedPrefill, SchedulingLimits
from router.scheduler.recovery import RecoveryPolicy, ShardRecovery, shutting_down
from router.scheduler.request_queue import BatchPlan, RequestQueue
from router.scheduler.running_requests import RunningRequests
from router.scheduler.steps import (NO_PREFILL, Prefilled, PrefillStep, ShardSteps, ShardsLost,
                                    StepOutcome, left_running, prefill_step)
from router.shards.step_types import CachedBatch, NewBatch, ShardRequest
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router.batcher")

# while idle, how often the loop asks whether the shards are still the ones it warmed up
IDLE_PROBE_S = 1.0
# how long a long prompt's next chunk, not yet due, waits with nothing running for the streams'
# next requests (clients sending them back to back leave gaps of a few milliseconds)
REQUEST_GAP_S = 0.05


class Batcher:
    def __init__(self, client, queue: RequestQueue[ActiveRequest], allocator: BlockAllocator,
                 limits: SchedulingLimits, metrics: Metrics,
                 recovery: RecoveryPolicy | None = None, *,
                 sessions: SessionStore | None = None):
        self.client = client
        self.queue = queue
        self.allocator = allocator
        self.limits = limits
        self.metrics = metrics
        metrics.kv_total_blocks.set(allocator.num_usable_blocks)
        metrics.kv_free_blocks.set(allocator.num_free_blocks)
        metrics.batch_max_total_tokens.set(allocator.num_usable_blocks * allocator.block_size)
        # request_id sessions' blocks (router.kv.sessions), let go of when the pool is reset or
        # an adapter unloaded; None where no API keeps sessions
        self.sessions = sessions
        self.running = RunningRequests(allocator, queue.prefix_cache, metrics, sessions)
        self.failures = FailureFanOut(self.running, queue, metrics)
        # without a policy (tests, one-off tools) a lost shard fails requests and nothing waits
        self.recovery = None
        if recovery is not None:
            self.recovery = ShardRecovery(recovery, queue, self.running,
                                          self.failures.fail_waiting)
        self.steps = ShardSteps(client, metrics, self.running, self.failures,
                                is_lost=self.recovery.is_lost if self.recovery else None,
                                stream_steps=limits.stream_decode_steps)
        self.chunked: ChunkedPrefill | None = None  # the long prompt being prefilled in chunks
        self._wake = asyncio.Event()
        # set by close(), when the model is going away: makes the error submit() raises instead
        self._refusal: Callable[[], RouterError] | None = None

    @property
    def healthy(self) -> bool:
        return self.recovery is None or self.recovery.healthy

    # ---- API side ---------------------------------------------------------------------------

    def close(self, refusal: Callable[[], RouterError]) -> None:
        """Refuses new requests: from now on submit() raises `refusal()`, a fresh error each time.

        The model is going away and no loop will read the queue: the first refusal stays."""
        if self._refusal is None:
            self._refusal = refusal

    def submit(self, item: ActiveRequest) -> None:
        if self._refusal is not None:
            raise self._refusal()
        self.queue.append(item)
        self.metrics.queue_size.set(len(self.queue))
        self._wake.set()

    def cancel(self, item: ActiveRequest) -> None:
        """The client went away: a waiting request leaves now, a running one at the next step."""
        item.is_cancelled = True
        if self.queue.remove(item):
            item.is_done = True
            self.metrics.queue_size.set(len(self.queue))

    def flush_prefix_cache(self) -> bool:
        """Lets go of every cached prompt block no request holds; whether the cache is empty."""
        cache = self.queue.prefix_cache
        if cache is None:
            return True
        cache.evict(len(cache))
        self.running.update_gauges()
        return len(cache) == 0

    def requests_by_adapter(self) -> tuple[Counter[str], Counter[str]]:
        """(waiting, running) requests on each LoRA adapter; the base model's are not counted.

        Running ones count until the shards let go of them."""
        waiting = Counter(i.adapter_id for i in self.queue.entries() if i.adapter_id is not None)
        running = Counter(i.adapter_id for i in self.running.all() if i.adapter_id is not None)
        return waiting, running

    def forget_adapter(self, adapter_id: str) -> None:
        """An unloaded adapter's cached prompt blocks and sessions' blocks are let go of."""
        if self.queue.prefix_cache is not None:
            self.queue.prefix_cache.forget_adapter(adapter_id)
        if self.sessions is not None:
            self.sessions.release_adapter(adapter_id)
        self.running.update_gauges()

    def fail_everything(self, error: RouterError) -> None:
        """The model is going away: every request, running or queued, hears `error`.

        Its loop already stopped; each request lets go of its blocks."""
        self.failures.fail_running(error)
        for item in self.queue.entries():
            self.queue.remove(item)
            self.failures.fail_waiting(item, error)
        self.chunked = None

    def stop_waiting(self) -> None:
        """The router is stopping: nothing waits for shards that are gone any more."""
        if self.recovery is not None:
            self.recovery.stop()

    # ---- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self._wait_for_work()
                await self._serve_until_idle()
            except Exception:
                # a fault that belongs to no single request: those in flight fail, the loop lives
                log.exception("unexpected error in the batching loop; failing the requests in "
                              "flight")
                await self._fail_in_flight(GenerationError("internal error in the batching loop"))
            self._batch_gauges([])

    async def _wait_for_work(self) -> None:
        """Sleeps until a request arrives; meanwhile checks that the shards did not restart.

        A restarted group has an empty cache and must be warmed up before it serves."""
        while True:
            if self.recovery is None:
                await self._wake.wait()
                break
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_PROBE_S)
                break
            except asyncio.TimeoutError:
                if await self.recovery.is_lost():
                    await self._lose_shards(GenerationError("the model shards restarted"))
        self._wake.clear()

    async def _serve_until_idle(self) -> None:
        running, waited_tokens = None, 0
        # whether the batch grew since its last decode call timed a step: its next call takes one
        # step, so that several are sized from what a step of this batch costs
        unmeasured = True
        while True:
            prefill = await self._prefill_next(running, waited_tokens)
            if await self._lost(prefill):
                running, waited_tokens = None, 0  # `running` died with the shards
                continue
            if prefill.ran:
                waited_tokens = 0
                unmeasured = True
            if prefill.is_running:  # it took its decode step inside the prefill's forward
                running = prefill.batch
                self._batch_gauges([running] if running is not None else [])
                continue
            batches = [b for b in (running, prefill.batch) if b is not None]
            if not batches:
                if prefill.ran:
                    continue  # a long prompt's chunks, with nothing decoding meanwhile
                if self.chunked is None:
                    break
                await self._until_chunk_due()  # or a request arrives
                continue
            self._batch_gauges(batches)
            steps = 1 if unmeasured else self.limits.decode_steps(
                self.steps.last_step_s, waiting=len(self.queue) > 0 or self.chunked is not None)
            decoded = await self.steps.decode(batches, steps)
            if await self._lost(decoded):
                running, waited_tokens = None, 0
                continue
            running = left_running(decoded, None)
            self._batch_gauges([running] if running is not None else [])
            unmeasured = False
            # the wait is counted in tokens passed, as --max-waiting-tokens is named (TGI adds one
            # per step even when speculating): a speculative step passes as many as the request
            # that got the most
            waited_tokens += self.steps.last_step_tokens

    async def _until_chunk_due(self) -> None:
        """Waits, REQUEST_GAP_S at most, until the next chunk is due or a request arrives.

        Clients sending requests back to back leave gaps of milliseconds between the streams'
        last step and their next request: a chunk started in one made that request wait. When
        none comes, the streams are done and the prompt goes on at once."""
        self._wake.clear()  # the queue was just tried: only a later arrival may cut the wait
        wait = min(self.chunked.not_before - time.monotonic(), REQUEST_GAP_S)
        try:
            await asyncio.wait_for(self._wake.wait(), wait)
        except asyncio.TimeoutError:
            self.chunked.go_now()

    def _batch_gauges(self, batches: list[CachedBatch]) -> None:
        self.metrics.batch_current_size.set(sum(len(b.request_ids) for b in batches))
        self.metrics.batch_current_max_tokens.set(sum(b.max_tokens for b in batches))

    async def _lost(self, outcome: PrefillStep | StepOutcome) -> bool:
        """Whether a step lost the shard group; the one place such a loss is handled.

        The group's requests are failed or sent back to the queue, and the loop waits for the
        restarted group.
        """
        if not isinstance(outcome, ShardsLost):
            return False
        await self._lose_shards(outcome.error)
        return True

    async def _prefill_next(self, running: CachedBatch | None, waited_tokens: int
                            ) -> PrefillStep | ShardsLost:
        """One prefill between two decode steps, if any is due.

        A new batch from the queue, or the next chunk of a long prompt; every other turn of the
        chunks, and every turn while the next chunk is not due, goes to queued prompts that fit
        one prefill (they need not wait for its end, nor for a chunk started between two of
        their requests)."""
        running_size = len(running.request_ids) if running is not None else 0
        whole_only = self.chunked is not None
        now, plan = time.monotonic(), None
        chunk_waits = whole_only and not self.chunked.due(now) and \
            self.steps.decode_cost.for_chunk(running_size > 0, now) is not None
        if not whole_only or ((self.chunked.queue_turn() or chunk_waits) and len(self.queue)):
            plan = self._next_plan(running_size=running_size, waited_tokens=waited_tokens,
                                   whole_only=whole_only)
        if plan is None and (not whole_only or chunk_waits):  # nothing fits, or not due yet
            return NO_PREFILL
        if plan is None:
            if running_size:
                self.metrics.counters.inc("tgi_batch_concat", reason="chunking")
            return prefill_step(await self._prefill_chunk(running), running)
        if running_size:
            self.metrics.counters.inc("tgi_batch_concat", reason=self.limits.join_reason(
                waited_tokens, chunking=self.queue.chunking))
        if plan.chunk_len is not None:
            (item,) = plan.entries
            self.running.start([item])
            self.chunked = ChunkedPrefill(item, next_start=item.cache_len)
            return prefill_step(await self._prefill_chunk(running), running)
        # shards that chunk take the running batch's step in the same forward (TGI's cached_batch)
        riding = running if self.queue.chunking else None
        return prefill_step(await self._prefill(plan, riding), riding)

    def _next_plan(self, *, running_size: int, waited_tokens: int, whole_only: bool = False
                   ) -> BatchPlan[ActiveRequest] | None:
        limits = self.limits
        min_size, max_size = limits.join_bounds(running_size, waited_tokens,
                                                chunking=self.queue.chunking)
        plan = self.queue.next_batch(min_size=min_size, max_size=max_size,
                                     prefill_token_budget=limits.max_batch_prefill_tokens,
                                     token_budget=limits.max_batch_total_tokens,
                                     whole_only=whole_only)
        if plan is not None:
            self.metrics.queue_size.set(len(self.queue))
            self.metrics.batch_next_size.observe(len(plan.entries))
            self.running.update_gauges()
        return plan

    async def _prefill_chunk(self, running: CachedBatch | None) -> CachedBatch | None | ShardsLost:
        """The next chunk of the long prompt being prefilled, the running batch riding along.

        The running batch takes its decode step in the same forward. Returns the running batch
        after that step (joined by the prompt's request after its last chunk), or, with nothing
        running, the batch the last chunk makes.
        """
        chunk, rows = self.chunked, len(running.request_ids) if running is not None else 0
        item = chunk.item
        if item.is_cancelled:
            self.chunked = None
            self.running.release(item.id)
            return running
        start = chunk.next_start
        decode_s = self.steps.decode_cost.for_chunk(running is not None)
        size = chunk.next_size(self.limits.max_batch_prefill_tokens, decode_s, decoding_rows=rows)
        is_last = chunk.is_last(size)
        batch = NewBatch(id=self.queue.new_batch_id(),
                         requests=[_shard_request(item, cache_len=start,
                                                  chunk_len=None if is_last else size)],
                         max_tokens=item.kv_tokens, max_blocks=len(item.allocation.block_ids))
        started = time.monotonic()
        outcome = await self.steps.prefill(batch, [item], running)
        if not isinstance(outcome, Prefilled):
            self.chunked = None
            return left_running(outcome, running)
        elapsed = time.monotonic() - started
        if item.is_done:  # refused: no more chunks
            self.chunked = None
            if running is None:
                return None
            return left_running(await self.steps.after_step(outcome.result, "prefill"), None)
        if is_last:
            self.chunked = None
            self.running.remember_prompts([item])
        else:
            chunk.advance(size, elapsed, decode_s)
            log.debug("prefill chunk of %d tokens at %d: %.3f s", size, start, elapsed)
            if running is None:
                return None
        return left_running(await self.steps.after_step(outcome.result, "prefill"), None)

    async def _prefill(self, plan: BatchPlan[ActiveRequest],
                       running: CachedBatch | None = None) -> CachedBatch | None | ShardsLost:
        """New requests, and with `running`, that batch's decode step in the same forward.

        The result is then `running`, joined by the new requests."""
        items = plan.entries
        self.running.start(items)
        batch = NewBatch(id=plan.batch_id, requests=[_shard_request(i) for i in items],
                         max_tokens=plan.max_tokens,
                         max_blocks=max(len(i.allocation.block_ids) for i in items))
        outcome = await self.steps.prefill(batch, items, running)
        if not isinstance(outcome, Prefilled):
            return left_running(outcome, running)
        # a refused request computed nothing worth caching (and its blocks are free)
        self.running.remember_prompts([i for i in items if not i.is_done])
        return left_running(await self.steps.after_step(outcome.result, "prefill"), None)

    async def _lose_shards(self, error: RouterError) -> None:
        """The shard group is gone: its requests are failed or re-queued, then the loop waits."""
        stopping = self.recovery.stopping
        self.failures.shards_lost(shutting_down() if stopping else error,
                                  max_attempts=self.recovery.policy.max_attempts,
                                  may_retry=not stopping)
        self.chunked = None
        await self.recovery.wait_for_shards()

    async def _fail_in_flight(self, error: RouterError) -> None:
        self.failures.fail_running(error)
        self.chunked = None
        try:
            await self.client.clear_cache()
        except Exception as err:  # called from the loop's last guard: nothing may escape it
            log.error("could not clear the shards' batches: %s", err)
        self.running.update_gauges()


def _shard_request(item: ActiveRequest, *, cache_len: int | None = None,
                   chunk_len: int | None = None) -> ShardRequest:
    return ShardRequest(item.id, item.request, item.allocation.block_ids,
                        cache_len=item.cache_len if cache_len is None else cache_len,
                        chunk_len=chunk_len)
