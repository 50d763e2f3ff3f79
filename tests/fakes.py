"""A scripted stand-in for the shards: the batcher's tests need no model and no torch."""
from __future__ import annotations

import asyncio

from proto import generate_pb2 as pb
from router.shard_client import ShardError


class FakeShardClient:
    """Each request generates token ids 1, 2, 3... and stops after max_new_tokens; batches are
    kept by id like a real shard, so filter/concatenate mistakes show up as errors."""

    def __init__(self, *, step_delay: float = 0.0):
        self.batches: dict[int, list[int]] = {}
        self.requests: dict[int, pb.Request] = {}
        self.generated: dict[int, int] = {}
        self.calls: list[tuple[str, object]] = []
        self.step_delay = step_delay
        self.fail_next: str | None = None
        self.decode_sizes: list[int] = []
        # a request the shard refuses on its own: returns why, or None to take it
        self.refuse = lambda request: None

    async def _maybe_fail(self, method: str) -> None:
        await asyncio.sleep(self.step_delay)
        if self.fail_next == method:
            self.fail_next = None
            raise ShardError(f"injected {method} failure")

    def _step(self, request_ids: list[int]) -> list[pb.Generation]:
        generations = []
        for rid in request_ids:
            request = self.requests[rid]
            self.generated[rid] += 1
            count = self.generated[rid]
            assert count <= request.stopping_parameters.max_new_tokens, f"request {rid} overran"
            generation = pb.Generation(request_id=rid, tokens=pb.Tokens(
                ids=[count], logprobs=[-0.5], texts=[f"t{count} "], is_special=[False]))
            if count == request.stopping_parameters.max_new_tokens:
                generation.generated_text.CopyFrom(pb.GeneratedText(
                    text="".join(f"t{i} " for i in range(1, count + 1)), generated_tokens=count,
                    finish_reason=pb.FINISH_REASON_LENGTH))
            generations.append(generation)
        return generations

    def _reply(self, cls, batch_id: int, generations):
        reply = cls(generations=generations)
        ids = self.batches[batch_id]
        if any(self.generated[r] < self.requests[r].stopping_parameters.max_new_tokens for r in ids):
            reply.batch.CopyFrom(pb.CachedBatch(id=batch_id, request_ids=ids, size=len(ids)))
        else:
            del self.batches[batch_id]
        return reply

    async def prefill(self, batch: pb.Batch,
                      cached_batch: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        """A cached batch takes its step in the same call and the complete new requests join it."""
        first = batch.requests[0]
        partial = (first.HasField("chunk_len")
                   and first.cache_len + first.chunk_len < len(first.input_ids))
        if partial:
            assert len(batch.requests) == 1, "a partial chunk is prefilled alone"
            self.calls.append(("chunk", (first.id, first.cache_len, first.chunk_len)))
        else:
            self.calls.append(("prefill", [r.id for r in batch.requests]))
        if cached_batch is not None:
            self.calls.append(("step", cached_batch.id))
        await self._maybe_fail("prefill")
        refused = [pb.RejectedRequest(request_id=r.id, reason=why)
                   for r in batch.requests if (why := self.refuse(r)) is not None]
        if refused:
            taken = [r for r in batch.requests if r.id not in {x.request_id for x in refused}]
            batch = pb.Batch(id=batch.id, requests=taken, size=len(taken))
            reply = await self._prefill_taken(batch, cached_batch, partial)
            reply.rejected.extend(refused)
            return reply
        return await self._prefill_taken(batch, cached_batch, partial)

    async def _prefill_taken(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None,
                             partial: bool) -> pb.PrefillResponse:
        if not batch.requests:
            if cached_batch is None:
                return pb.PrefillResponse()
            step = await self.decode([cached_batch])  # the same fields, numbered alike
            return pb.PrefillResponse.FromString(step.SerializeToString())
        running, generations, target = [], [], batch.id
        if cached_batch is not None:
            if cached_batch.id not in self.batches:
                raise ShardError(f"batch {cached_batch.id} not found")
            running, target = self.batches.pop(cached_batch.id), cached_batch.id
            generations = self._step(running)
        if partial:
            if cached_batch is None:
                return pb.PrefillResponse()
            self.batches[target] = running
            return self._reply(pb.PrefillResponse, target, generations)
        for request in batch.requests:
            assert request.blocks, "every request must carry its KV blocks"
            self.requests[request.id] = request
            self.generated[request.id] = 0
        new_ids = [r.id for r in batch.requests]
        self.batches[target] = running + new_ids
        return self._reply(pb.PrefillResponse, target, generations + self._step(new_ids))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        self.calls.append(("decode", [b.id for b in batches]))
        await self._maybe_fail("decode")
        ids = []
        for b in batches:
            if b.id not in self.batches:
                raise ShardError(f"batch {b.id} not found")
            ids += self.batches.pop(b.id)
        for rid in ids:
            assert self.generated[rid] < self.requests[rid].stopping_parameters.max_new_tokens, \
                f"finished request {rid} was decoded again"
        self.batches[batches[0].id] = ids
        self.decode_sizes.append(len(ids))
        return self._reply(pb.DecodeResponse, batches[0].id, self._step(ids))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        self.calls.append(("filter", list(request_ids)))
        assert set(request_ids) <= set(self.batches[batch_id])
        self.batches[batch_id] = list(request_ids)
        return pb.CachedBatch(id=batch_id, request_ids=request_ids, size=len(request_ids))

    async def clear_cache(self, batch_id: int | None = None) -> None:
        self.calls.append(("clear", batch_id))
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)
