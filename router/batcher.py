"""The continuous-batching task: prefill new requests, decode the running batch, filter what finished.

It is the only module that drives the shards. Between two decode steps it asks the queue for more work.
With shards that chunk, new requests are prefilled in the same forward as the running batch's next
step (TGI's cached_batch) and join it; otherwise in their own batch, merged at the next decode.
A prompt longer than the prefill budget (when the shards chunk) is computed one chunk between two
decode steps, so it never freezes the streams already running; chunks are sized from the measured
step costs (router.chunk_sizing) so that each stalls the streams by about one decode step.
Delivery: each request's events go to its own asyncio.Queue (TokenEvent, then None or a RouterError).

Failures stay with their owner. Anything raised while preparing one request's data for the shards or
while reading its generation fails that request alone (its blocks are freed, the others go on); a
shard call that fails fails the batches in it; an error outside both fails what is in flight and the
loop goes on. When the shards themselves are gone, router.recovery waits for their restart, and the
requests that had received nothing yet go back to the queue.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Link, SpanContext, SpanKind

from proto import generate_pb2 as pb
from proto.tracing import tracer, tracing_enabled
from router.block_allocator import BlockAllocator
from router.chunk_sizing import DecodeCost, chunk_tokens
from router.errors import GenerationError, RouterError
from router.metrics import Metrics
from router.recovery import RecoveryPolicy, ShardRecovery, shutting_down
from router.request_queue import BatchPlan, QueueEntry, RequestQueue
from router.schemas import FinalInfo, FinishReason, GenerateRequest, Token, TokenEvent
from router.shard_client import ShardError

log = logging.getLogger("tgi.router.batcher")
_TRACER = tracer("tgi.router")

# while idle, how often the loop asks whether the shards are still the ones it warmed up
IDLE_PROBE_S = 1.0

_GRAMMAR_TYPES = {"json": pb.GRAMMAR_TYPE_JSON, "regex": pb.GRAMMAR_TYPE_REGEX}
_FINISH = {pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
           pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE}


@dataclass(slots=True)
class ActiveRequest:
    """A request from submission to its last event; `events` is what the API layer reads."""

    entry: QueueEntry
    request: GenerateRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_cancelled: bool = False
    is_done: bool = False
    delivered: int = 0  # events sent to the API side
    batched_at: float = 0.0
    span_context: SpanContext | None = None  # the HTTP request's span, when tracing


@dataclass(slots=True)
class ChunkedPrefill:
    item: ActiveRequest
    next_start: int  # prompt tokens already in the cache
    s_per_token: float | None = None  # what the previous chunk cost, to size the next


@dataclass(slots=True)
class SchedulingLimits:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_batch_size: int | None


class Batcher:
    def __init__(self, client, queue: RequestQueue, allocator: BlockAllocator,
                 limits: SchedulingLimits, metrics: Metrics,
                 recovery: RecoveryPolicy | None = None):
        self.client = client
        self.queue = queue
        self.allocator = allocator
        self.limits = limits
        self.metrics = metrics
        metrics.kv_total_blocks.set(allocator.num_usable_blocks)
        metrics.kv_free_blocks.set(allocator.num_free_blocks)
        metrics.batch_max_total_tokens.set(allocator.num_usable_blocks * allocator.block_size)
        self.active: dict[int, ActiveRequest] = {}  # request id -> request, from prefill to end
        self.chunked: ChunkedPrefill | None = None  # the long prompt being prefilled in chunks
        self.decode_cost = DecodeCost()
        self._wake = asyncio.Event()
        # counts losses of the shard group: a batch id from before one names nothing any more
        self.shard_generation = 0
        # without a policy (tests, one-off tools) a lost shard fails requests and nothing waits
        self.recovery = (ShardRecovery(recovery, queue, allocator, self._fail_waiting)
                         if recovery is not None else None)

    @property
    def healthy(self) -> bool:
        return self.recovery is None or self.recovery.healthy

    # ---- API side ---------------------------------------------------------------------------

    def submit(self, item: ActiveRequest) -> None:
        self.queue.append(item.entry)
        self.metrics.queue_size.set(len(self.queue))
        self._wake.set()

    def cancel(self, item: ActiveRequest) -> None:
        """The client went away: a waiting request leaves now, a running one at the next step."""
        item.is_cancelled = True
        if self.queue.remove(item.entry):
            item.is_done = True
            self.metrics.queue_size.set(len(self.queue))

    def stop_waiting(self) -> None:
        """The router is stopping: requests queued for shards that are not there will never run;
        they get a 503 now (and so do those of a loss found later) instead of holding the
        shutdown until its grace period ends. With the shards there, queued requests drain."""
        if self.recovery is None:
            return
        self.recovery.stopping = True
        if self.healthy:
            return
        for entry in self.queue.entries():
            if self.queue.remove(entry):
                self._fail_waiting(entry, shutting_down())

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
        """Sleeps until a request arrives; meanwhile checks that the shards did not restart (a
        restarted group has an empty cache and must be warmed up before it serves)."""
        while True:
            if self.recovery is None:
                await self._wake.wait()
                break
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_PROBE_S)
                break
            except asyncio.TimeoutError:
                is_alive = self.recovery.policy.is_alive
                # asked twice: one slow answer must not cost a warm-up and the prefix cache
                if not await is_alive() and not await is_alive():
                    await self._lose_shards(GenerationError("the model shards restarted"))
        self._wake.clear()

    async def _serve_until_idle(self) -> None:
        running, waiting_steps = None, 0
        while True:
            generation = self.shard_generation
            did_prefill, new, stepped = await self._prefill_next(running, waiting_steps)
            if generation != self.shard_generation:
                # the shards were lost during that step: `running` died with them
                running, waiting_steps = None, 0
                continue
            if did_prefill:
                waiting_steps = 0
            if stepped:
                # it took its decode step inside the prefill's forward
                running = new
                self._batch_gauges([running] if running is not None else [])
                continue
            batches = [b for b in (running, new) if b is not None]
            if not batches:
                if did_prefill:
                    continue  # a long prompt's chunks, with nothing decoding meanwhile
                break
            self._batch_gauges(batches)
            running = await self._decode(batches)
            waiting_steps += 1
            if generation != self.shard_generation:
                running = None

    def _batch_gauges(self, batches: list[pb.CachedBatch]) -> None:
        self.metrics.batch_current_size.set(sum(len(b.request_ids) for b in batches))
        self.metrics.batch_current_max_tokens.set(sum(b.max_tokens for b in batches))

    async def _prefill_next(self, running: pb.CachedBatch | None, waiting_steps: int
                            ) -> tuple[bool, pb.CachedBatch | None, bool]:
        """One prefill between two decode steps, if any is due: the next chunk of a long prompt,
        else a new batch from the queue. Returns (whether a prefill ran, the batch it made,
        whether that is the running batch after a step taken in the same forward)."""
        running_size = len(running.request_ids) if running is not None else 0
        if self.chunked is not None:
            if running_size:
                self.metrics.counters.inc("tgi_batch_concat", reason="chunking")
            return True, await self._prefill_chunk(running), running is not None
        plan = self._next_plan(running_size=running_size, waiting_steps=waiting_steps)
        if plan is None:
            return False, None, False
        if running_size:
            reason = ("wait_exceeded" if waiting_steps >= self.limits.max_waiting_tokens
                      else "backpressure")
            self.metrics.counters.inc("tgi_batch_concat", reason=reason)
        if plan.chunk_len is not None:
            (entry,) = plan.entries
            self._activate([entry.payload])
            self.chunked = ChunkedPrefill(entry.payload, next_start=entry.cache_len)
            return True, await self._prefill_chunk(running), running is not None
        # shards that chunk take the running batch's step in the same forward (TGI's cached_batch)
        riding = running if self.queue.chunking else None
        return True, await self._prefill(plan, riding), riding is not None

    def _next_plan(self, *, running_size: int, waiting_steps: int) -> BatchPlan | None:
        limits = self.limits
        min_size = None
        if running_size and waiting_steps < limits.max_waiting_tokens:
            min_size = max(1, math.floor(running_size * limits.waiting_served_ratio))
        max_size = None
        if limits.max_batch_size is not None:
            max_size = max(limits.max_batch_size - running_size, 0)
        plan = self.queue.next_batch(min_size=min_size, max_size=max_size,
                                     prefill_token_budget=limits.max_batch_prefill_tokens,
                                     token_budget=limits.max_batch_total_tokens)
        if plan is not None:
            self.metrics.queue_size.set(len(self.queue))
            self.metrics.batch_next_size.observe(len(plan.entries))
            self._kv_gauges()
        return plan

    def _kv_gauges(self) -> None:
        self.metrics.kv_free_blocks.set(self.allocator.num_free_blocks)
        if self.queue.prefix_cache is not None:
            self.metrics.kv_prefix_blocks.set(len(self.queue.prefix_cache))

    def _activate(self, items: list[ActiveRequest]) -> None:
        now = time.monotonic()
        for item in items:
            item.batched_at = now
            item.entry.attempts += 1
            self.active[item.entry.id] = item

    async def _prefill_chunk(self, running: pb.CachedBatch | None) -> pb.CachedBatch | None:
        """The next chunk of the long prompt being prefilled, with the running batch taking its
        decode step in the same forward. Returns the running batch after that step (joined by the
        prompt's request after its last chunk), or, with nothing running, the batch the last chunk
        makes."""
        chunk = self.chunked
        item = chunk.item
        if item.is_cancelled:
            self.chunked = None
            self._release(item.entry.id)
            return running
        start = chunk.next_start
        decode_s = self.decode_cost.seconds if running is not None else None
        size = chunk_tokens(item.entry.input_length - start, self.limits.max_batch_prefill_tokens,
                            decode_s=decode_s, chunk_s_per_token=chunk.s_per_token)
        is_last = start + size == item.entry.input_length
        requests, _ = self._prepare([item], cache_len=start, chunk_len=None if is_last else size)
        if not requests:
            self.chunked = None
            return running
        batch = pb.Batch(id=self.queue.new_batch_id(), requests=requests, size=1,
                         max_tokens=item.entry.kv_tokens,
                         max_blocks=len(item.entry.allocation.block_ids))
        started = time.monotonic()
        reply = await self._prefill_call(batch, [item], running)
        if reply is None:
            self.chunked = None
            return None
        elapsed = time.monotonic() - started
        if item.is_done:  # the shard refused it: no more chunks
            self.chunked = None
            return await self._after_step(reply, "prefill") if running is not None else None
        if is_last:
            self.chunked = None
            self._remember_prompts([item.entry])
        else:
            chunk.next_start = start + size
            # what the chunk's tokens added to the step: the riding batch's own step costs decode_s
            added = elapsed - (decode_s or 0.0)
            chunk.s_per_token = max(added, elapsed / 4) / size
            log.debug("prefill chunk of %d tokens at %d: %.3f s", size, start, elapsed)
            if running is None:
                return None
        return await self._after_step(reply, "prefill")

    async def _prefill(self, plan: BatchPlan,
                       running: pb.CachedBatch | None = None) -> pb.CachedBatch | None:
        """New requests; with `running`, that batch takes its decode step in the same forward and
        the result is it, joined by the new requests."""
        items = [e.payload for e in plan.entries]
        self._activate(items)
        requests, items = self._prepare(items)
        if not items:
            return running
        batch = pb.Batch(id=plan.batch_id, requests=requests, size=len(items),
                         max_tokens=sum(i.entry.kv_tokens for i in items),
                         max_blocks=max(len(i.entry.allocation.block_ids) for i in items))
        reply = await self._prefill_call(batch, items, running)
        if reply is None:
            return None
        # a request the shard refused computed nothing worth caching (and its blocks are free)
        self._remember_prompts([i.entry for i in items if not i.is_done])
        return await self._after_step(reply, "prefill")

    def _prepare(self, items: list[ActiveRequest], **chunk
                 ) -> tuple[list[pb.Request], list[ActiveRequest]]:
        """Each request's message for the shards, encoded once so that a value the wire cannot
        carry fails its own request here rather than the whole batch later."""
        requests, kept = [], []
        for item in items:
            try:
                request = request_proto(item, **chunk)
                encode(request)
            except Exception as err:
                self._fail_request(item, "prepare", err)
                self._release(item.entry.id)
                continue
            requests.append(request)
            kept.append(item)
        return requests, kept

    async def _prefill_call(self, batch: pb.Batch, items: list[ActiveRequest],
                            running: pb.CachedBatch | None) -> pb.PrefillResponse | None:
        """One Prefill, with `running` riding in it; on failure the new requests and the riding
        batch fail together (the shard dropped both) and None is returned."""
        riding = [running] if running is not None else []

        def all_items() -> list[ActiveRequest]:
            return items + self._items(riding)

        reply = await self._call("prefill", self.client.prefill(batch, running), all_items)
        if isinstance(reply, ShardError):
            await self._fail(all_items(), [batch.id] + [b.id for b in riding], reply)
            return None
        for rejected in reply.rejected:  # refused by the shard one by one: the others went on
            item = self.active.get(rejected.request_id)
            if item is not None:
                self._fail_request(item, "shard", rejected.reason)
                self._release(rejected.request_id)
        return reply

    def _remember_prompts(self, entries: list[QueueEntry]) -> None:
        """Computed prompts' full blocks join the prefix cache (they never change afterwards)."""
        cache = self.queue.prefix_cache
        if cache is None:
            return
        for entry in entries:
            if entry.prompt_ids is not None:
                try:
                    cache.insert(entry.prompt_ids, entry.allocation.block_ids)
                except Exception:  # the request goes on; only its prompt is not reused
                    log.exception("could not cache the prompt of request %d", entry.id)
            if entry.cache_len:
                self.metrics.counters.inc("tgi_prefix_cache_hits", entry.cache_len)

    def _items(self, batches: list[pb.CachedBatch]) -> list[ActiveRequest]:
        """The requests of `batches` (only on failure or when tracing: not per step)."""
        ids = (rid for b in batches for rid in b.request_ids)
        return [self.active[i] for i in ids if i in self.active]

    async def _decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        def items() -> list[ActiveRequest]:
            return self._items(batches)

        reply = await self._call("decode", self.client.decode(batches), items)
        if isinstance(reply, ShardError):
            await self._fail(items(), [b.id for b in batches], reply)
            return None
        return await self._after_step(reply, "decode")

    async def _call(self, method: str, call, items):
        """Runs one shard step, recording TGI's batch metrics (and the decode step's cost, to size
        prefill chunks); a ShardError is returned, not raised."""
        metrics = self.metrics
        metrics.counters.inc("tgi_batch_inference_count", method=method)
        started = time.monotonic()
        try:
            if tracing_enabled():
                # one span per step, linked to every request riding in it; the shards' spans
                # become its children through the gRPC metadata
                links = [Link(i.span_context) for i in items() if i.span_context is not None]
                with _TRACER.start_as_current_span(method, kind=SpanKind.CLIENT, links=links):
                    reply = await call
            else:
                reply = await call
        except ShardError as err:
            metrics.counters.inc("tgi_batch_inference_failure", method=method)
            return err
        metrics.counters.inc("tgi_batch_inference_success", method=method)
        elapsed = time.monotonic() - started
        if method == "decode":
            self.decode_cost.observe(elapsed)
            log.debug("decode step: %.3f s", elapsed)
        metrics.batch_inference_duration.labels(method).observe(elapsed)
        metrics.batch_forward_duration.labels(method).observe(reply.forward_ns / 1e9)
        metrics.batch_decode_duration.labels(method).observe(reply.decode_ns / 1e9)
        if reply.HasField("concat_ns"):
            metrics.batch_concat_duration.labels(method).observe(reply.concat_ns / 1e9)
        return reply

    async def _after_step(self, reply, method: str) -> pb.CachedBatch | None:
        started = time.monotonic()
        try:
            return await self._deliver_and_filter(reply)
        finally:
            self.metrics.batch_filter_duration.labels(method).observe(time.monotonic() - started)
            self._kv_gauges()

    async def _deliver_and_filter(self, reply) -> pb.CachedBatch | None:
        for generation in reply.generations:
            item = self.active.get(generation.request_id)
            if item is not None and not item.is_done and not item.is_cancelled:
                try:
                    self._deliver(item, generation)
                except Exception as err:
                    # done now: the filter below drops it from the shards and frees its blocks
                    self._fail_request(item, "read", err)
        if not reply.HasField("batch"):
            for generation in reply.generations:
                self._release(generation.request_id)
            return None
        return await self._filter(reply.batch)

    async def _filter(self, batch: pb.CachedBatch) -> pb.CachedBatch | None:
        """Drops finished and cancelled requests from the shards' batch and frees their blocks."""
        live = []
        for rid in batch.request_ids:
            item = self.active.get(rid)
            if item is None or item.is_done or item.is_cancelled:
                self._release(rid)
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
            await self._fail([self.active[r] for r in live], [batch.id], err)
            return None

    def _deliver(self, item: ActiveRequest, generation: pb.Generation) -> None:
        event = generation_event(generation)
        if event.final is not None:
            item.is_done = True
        item.delivered += 1
        item.events.put_nowait(event)

    def _fail_request(self, item: ActiveRequest, stage: str, err: Exception | str) -> None:
        """One request's own failure: its client hears of it, the batch goes on without it.
        `err` is what was raised, or the shard's reason when it refused the request."""
        if isinstance(err, str):
            log.warning("the shards refused request %d: %s", item.entry.id, err)
            message = err
        else:
            log.error("request %d failed while its data was %s: %r", item.entry.id,
                      {"prepare": "prepared for the shards", "read": "read back"}[stage], err,
                      exc_info=err)
            message = f"{type(err).__name__}: {err}"
        if not item.is_done:
            item.events.put_nowait(GenerationError(message))
        item.is_done = True

    def _fail_items(self, items: list[ActiveRequest], error: RouterError) -> None:
        """Each request hears `error` (unless it already ended) and lets go of its blocks."""
        for item in items:
            if not item.is_done:
                item.events.put_nowait(error)
            self._release(item.entry.id)

    def _fail_waiting(self, entry: QueueEntry, error: RouterError) -> None:
        item = entry.payload
        item.is_done = True
        item.events.put_nowait(error)
        self.metrics.queue_size.set(len(self.queue))

    def _release(self, request_id: int) -> None:
        item = self._drop(request_id)
        if item is not None:
            item.is_done = True

    def _drop(self, request_id: int) -> ActiveRequest | None:
        """Takes a request out of the running ones and frees its blocks; it may run again."""
        item = self.active.pop(request_id, None)
        if item is not None and item.entry.allocation is not None:
            self.allocator.free(item.entry.allocation)
        return item

    async def _fail(self, items: list[ActiveRequest], batch_ids: list[int], err: Exception) -> None:
        log.error("shard step failed for %d requests: %s", len(items), err)
        error = err if isinstance(err, RouterError) else GenerationError(str(err))
        if self.recovery is not None and not await self.recovery.policy.is_alive():
            await self._lose_shards(error)
            return
        self._fail_items(items, error)
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError as clear_err:
                log.error("could not clear batch %d: %s", batch_id, clear_err)

    async def _lose_shards(self, error: RouterError) -> None:
        """The shard group is gone: requests that received nothing go back to the queue (once:
        one that kills the shards each time must not use up the restarts); the others get the
        error. Then the loop waits for the restarted group."""
        self.shard_generation += 1
        if self.recovery.stopping:
            error = shutting_down()
        retry = [item for item in self.active.values()
                 if not item.is_done and not item.is_cancelled and item.delivered == 0
                 and item.entry.attempts < self.recovery.policy.max_attempts
                 and not self.recovery.stopping]
        for item in retry:
            self._drop(item.entry.id)
        self._fail_items(list(self.active.values()), error)
        self.chunked = None
        self.queue.requeue_front([item.entry for item in retry])
        self.metrics.queue_size.set(len(self.queue))
        await self.recovery.wait_for_shards()
        self._kv_gauges()
        self.metrics.kv_total_blocks.set(self.allocator.num_usable_blocks)

    async def _fail_in_flight(self, error: RouterError) -> None:
        self._fail_items(list(self.active.values()), error)
        self.chunked = None
        try:
            await self.client.clear_cache()
        except Exception as err:  # called from the loop's last guard: nothing may escape it
            log.error("could not clear the shards' batches: %s", err)
        self._kv_gauges()


def _tokens(run: pb.Tokens) -> list[Token]:
    special = list(run.is_special) or [False] * len(run.ids)
    return [Token(i, t, _logprob(lp), s)
            for i, t, lp, s in zip(run.ids, run.texts, run.logprobs, special)]


def request_proto(item: ActiveRequest, *, cache_len: int | None = None,
                   chunk_len: int | None = None) -> pb.Request:
    request = item.request
    s, st = request.sampling, request.stopping
    return pb.Request(
        id=item.entry.id, inputs=request.inputs, input_ids=request.input_ids,
        parameters=pb.NextTokenChooserParameters(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
            do_sample=s.do_sample, seed=s.seed, repetition_penalty=s.repetition_penalty,
            watermark=s.watermark, frequency_penalty=s.frequency_penalty, min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            grammar_type=_GRAMMAR_TYPES[request.grammar[0]] if request.grammar else
            pb.GRAMMAR_TYPE_NONE,
            grammar=request.grammar[1] if request.grammar else ""),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=st.max_new_tokens, stop_sequences=st.stop_sequences,
            ignore_eos_token=st.ignore_eos, min_new_tokens=st.min_new_tokens,
            stop_token_ids=st.stop_token_ids),
        prefill_logprobs=request.prefill_logprobs, top_n_tokens=request.top_n_tokens,
        blocks=item.entry.allocation.block_ids,
        cache_len=item.entry.cache_len if cache_len is None else cache_len, chunk_len=chunk_len,
        skip_special_tokens=request.skip_special_tokens)


def generation_event(generation: pb.Generation) -> TokenEvent:
    tokens = generation.tokens
    event = TokenEvent(token=Token(tokens.ids[0], tokens.texts[0], _logprob(tokens.logprobs[0]),
                                   tokens.is_special[0]))
    if generation.top_tokens:
        event.top_tokens = _tokens(generation.top_tokens[0])
    if generation.HasField("prefill_tokens"):
        event.prefill = _tokens(generation.prefill_tokens)
    if generation.HasField("generated_text"):
        gt = generation.generated_text
        event.final = FinalInfo(gt.text, gt.generated_tokens, _FINISH[gt.finish_reason],
                                gt.seed if gt.HasField("seed") else None)
    return event


def _logprob(value: float) -> float | None:
    # NaN (not computed) and -inf (a token the grammar masked) have no JSON spelling
    return value if math.isfinite(value) else None


def encode(request: pb.Request) -> bytes:
    return request.SerializeToString()
