"""A scripted stand-in for the shards, in the router's own types (router.shards.step_types): the scheduler's
tests need no model, no torch and no protobuf."""
from __future__ import annotations

import asyncio

from router.schemas import FinalInfo, FinishReason, Token, TokenEvent
from router.shards.client import ShardError
from router.shards.convert import AdapterInfo
from router.shards.step_types import (CachedBatch, Generation, NewBatch, PreparedBatch, Rejection,
                                      ShardRequest, StepResult, StepTimings)


class FakeShardClient:
    """Each request generates token ids 1, 2, 3... and stops after max_new_tokens; batches are
    kept by id like a real shard, so filter/concatenate mistakes show up as errors."""

    def __init__(self, *, step_delay: float = 0.0):
        self.batches: dict[int, list[int]] = {}
        self.requests: dict[int, ShardRequest] = {}
        self.generated: dict[int, int] = {}
        self.finished_early: set[int] = set()  # ended by a stop sequence
        self.calls: list[tuple[str, object]] = []
        self.step_delay = step_delay
        self.fail_next: str | None = None
        self.decode_sizes: list[int] = []
        self.decode_steps_asked: list[int] = []  # max_steps of each decode call
        # tokens a decode step gives each request (several: as speculation accepting drafts)
        self.tokens_per_decode = 1
        # a request the shard refuses on its own: returns why, or None to take it
        self.refuse = lambda request: None
        # a request whose message cannot be built: returns the error, or None
        self.untranslatable = lambda request: None
        # a generation that cannot be read back: (request, token count) -> the error, or None
        self.unreadable = lambda request, count: None
        # LoRA adapters loaded (name -> directory), as LoadAdapter left them; a request naming
        # another is refused alone, as the shard refuses it
        self.adapters: dict[str, str] = {}
        # an adapter the shard cannot take: (name, path) -> the reason, or None to load it
        self.refuse_adapter = lambda name, path: None

    async def _maybe_fail(self, method: str) -> None:
        await asyncio.sleep(self.step_delay)
        if self.fail_next == method:
            self.fail_next = None
            raise ShardError(f"injected {method} failure")

    def _max_new_tokens(self, request_id: int) -> int:
        return self.requests[request_id].request.stopping.max_new_tokens

    def _step(self, request_ids: list[int], tokens: int = 1) -> list[Generation]:
        generations = []
        for rid in request_ids:
            events, error = [], None
            limit = self._max_new_tokens(rid)
            for _ in range(tokens):
                self.generated[rid] += 1
                count = self.generated[rid]
                assert count <= limit, f"request {rid} overran"
                error = self.unreadable(self.requests[rid], count)
                if error is not None:
                    break
                event = TokenEvent(token=Token(count, f"t{count} ", -0.5, False))
                events.append(event)
                # as the shard: a stop sequence ending in this token's text ends the output there
                before = "".join(f"t{i} " for i in range(1, count))
                text = before + event.token.text
                ends = [text.find(stop, max(len(before) - len(stop) + 1, 0)) + len(stop)
                        for stop in self.requests[rid].request.stopping.stop_sequences
                        if text.find(stop, max(len(before) - len(stop) + 1, 0)) >= 0]
                if ends:
                    event.token.text = text[len(before):min(ends)]
                    event.final = FinalInfo(text[:min(ends)], count, FinishReason.STOP_SEQUENCE,
                                            None)
                    self.finished_early.add(rid)
                    break
                if count == limit:
                    event.final = FinalInfo(text, count, FinishReason.LENGTH, None)
                    break
            generations.append(Generation(rid, [], error) if error is not None
                               else Generation(rid, events))
        return generations

    def _result(self, batch_id: int, generations: list[Generation]) -> StepResult:
        ids = self.batches[batch_id]
        result = StepResult(generations=generations, timings=StepTimings(forward_ns=1, decode_ns=1))
        if any(self.generated[r] < self._max_new_tokens(r) and r not in self.finished_early
               for r in ids):
            result.batch = CachedBatch(batch_id, list(ids))
        else:
            del self.batches[batch_id]
        return result

    def prepare(self, batch: NewBatch) -> tuple[PreparedBatch, list[Rejection]]:
        """As the real client: the requests whose message cannot be built are left out."""
        untranslatable = [Rejection(r.id, f"ValueError: {err}", err) for r in batch.requests
                          if (err := self.untranslatable(r)) is not None]
        left_out = {r.request_id for r in untranslatable}
        sent = NewBatch(batch.id, [r for r in batch.requests if r.id not in left_out],
                        batch.max_tokens, batch.max_blocks)  # the fake's message
        return PreparedBatch([r.id for r in sent.requests], sent), untranslatable

    async def prefill(self, prepared: PreparedBatch,
                      running: CachedBatch | None = None) -> StepResult:
        """A running batch takes its step in the same call and the complete new requests join it."""
        batch = prepared.message
        requests = batch.requests
        assert requests, "a prefill with no request is never sent"
        first = requests[0]
        partial = first.chunk_len is not None
        if partial:
            assert len(requests) == 1, "a partial chunk is prefilled alone"
            assert first.cache_len + first.chunk_len < len(first.request.input_ids)
            self.calls.append(("chunk", (first.id, first.cache_len, first.chunk_len)))
        else:
            self.calls.append(("prefill", [r.id for r in requests]))
        if running is not None:
            self.calls.append(("step", running.id))
        await self._maybe_fail("prefill")
        refused = [Rejection(r.id, why) for r in requests
                   if (why := self.refuse(r) or self._unknown_adapter(r)) is not None]
        taken = [r for r in requests if r.id not in {x.request_id for x in refused}]
        result = await self._prefill_taken(batch.id, taken, running, partial)
        result.rejected[:0] = refused
        return result

    async def _prefill_taken(self, batch_id: int, requests: list[ShardRequest],
                             running: CachedBatch | None, partial: bool) -> StepResult:
        if not requests:
            return await self.decode([running]) if running is not None else StepResult()
        ids, generations, target = [], [], batch_id
        if running is not None:
            if running.id not in self.batches:
                raise ShardError(f"batch {running.id} not found")
            ids, target = self.batches.pop(running.id), running.id
            generations = self._step(ids)
        if partial:
            if running is None:
                return StepResult()
            self.batches[target] = ids
            return self._result(target, generations)
        for request in requests:
            assert request.blocks, "every request must carry its KV blocks"
            self.requests[request.id] = request
            self.generated[request.id] = 0
        new_ids = [r.id for r in requests]
        self.batches[target] = ids + new_ids
        return self._result(target, generations + self._step(new_ids))

    async def decode(self, batches: list[CachedBatch], max_steps: int = 1,
                     on_step=None) -> StepResult:
        """Up to max_steps steps, ending after one in which a request finished, as the shards;
        with on_step, each step but the last handed to it as it ends (as DecodeStream)."""
        self.calls.append(("decode", [b.id for b in batches]))
        self.decode_steps_asked.append(max_steps)
        await self._maybe_fail("decode")
        ids = []
        for b in batches:
            if b.id not in self.batches:
                raise ShardError(f"batch {b.id} not found")
            ids += self.batches.pop(b.id)
        for rid in ids:
            assert self.generated[rid] < self._max_new_tokens(rid) \
                and rid not in self.finished_early, f"finished request {rid} was decoded again"
        self.batches[batches[0].id] = ids
        self.decode_sizes.append(len(ids))
        generations, steps = self._step(ids, self.tokens_per_decode), 1
        while steps < max_steps and not any(g.error is not None or g.events[-1].final is not None
                                            for g in generations):
            if on_step is not None:  # the step just ended, as the next one begins
                on_step(StepResult(generations=generations,
                                   timings=StepTimings(forward_ns=1, decode_ns=1)))
            await asyncio.sleep(self.step_delay)
            following = self._step(ids, self.tokens_per_decode)
            if on_step is not None:
                generations = following
            else:
                for generation, more in zip(generations, following):
                    generation.events += more.events
                    generation.error = more.error
            steps += 1
        result = self._result(batches[0].id, generations)
        result.steps = steps
        return result

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        self.calls.append(("filter", list(request_ids)))
        assert set(request_ids) <= set(self.batches[batch_id])
        self.batches[batch_id] = list(request_ids)
        return CachedBatch(batch_id, list(request_ids))

    def _unknown_adapter(self, request: ShardRequest) -> str | None:
        name = request.request.adapter_id
        return None if name is None or name in self.adapters else f"adapter {name!r} is not loaded"

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        self.calls.append(("load_adapter", (name, path)))
        if name in self.adapters:
            raise ShardError(f"adapter {name!r} is already loaded", "ALREADY_EXISTS")
        reason = self.refuse_adapter(name, path)
        if reason is not None:
            raise ShardError(reason, "INVALID_ARGUMENT")
        self.adapters[name] = path
        return AdapterInfo(rank=8, alpha=16.0, scaling=2.0, target_modules=("q_proj", "v_proj"),
                           base_model="tiny")

    async def unload_adapter(self, name: str) -> None:
        self.calls.append(("unload_adapter", name))
        if name not in self.adapters:
            raise ShardError(f"adapter {name!r} is not loaded", "NOT_FOUND")
        del self.adapters[name]

    async def clear_cache(self, batch_id: int | None = None) -> None:
        self.calls.append(("clear", batch_id))
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)
