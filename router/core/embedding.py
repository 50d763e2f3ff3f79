"""A model's embeddings: inputs from every request batched into Embed calls, one call at a time.

Each call goes to the shards between the batching loop's steps (the shard's engine thread takes
calls in turn), so a call's size bounds how long it holds the running streams back. While a batch
decodes, a call is sized as a prefill chunk beside one stream is
(router/scheduler/chunk_sizing.py): about half a decode step's worth of tokens, from what the last
calls' forwards cost per token, a decoder's longer input going in chunks over several calls; with
nothing decoding, a call takes the whole budget. (An encoder's input is computed whole; an encoder
has no stream to hold back.) A call's fixed cost comes on top of its share: where it is more than
a step (a small decoder on a quiet CPU), the streams beside it slow by that much per call.

While the shard group restarts, inputs wait for it as queued generation requests do, on the
batching loop's recovery (router/scheduler/recovery.py) and its bound: an input whose call was lost
with the shards goes again, once, as a request that had received nothing does.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy

from router.errors import GenerationError, NotServedError, RouterError, ValidationError
from router.scheduler.chunk_sizing import MIN_CHUNK_TOKENS, STALL_RATIO
from router.scheduler.recovery import RETRY_INTERVAL_S, ShardRecovery
from router.shards.client import ShardError

# tokens one call may carry with nothing decoding: past a few thousand a bigger forward is no
# faster per token, and the inputs behind it wait for all of it
MAX_CALL_TOKENS = 8192
MAX_CALL_INPUTS = 256
# the fewest tokens of a chunk beside a decoding batch: fewer than a prompt chunk's least
# (MIN_CHUNK_TOKENS), as a call's cost must stay within its share of a step even where a forward's
# fixed cost is most of one, and the stall bound is what an embedding beside streams promises
MIN_EMBED_CHUNK_TOKENS = 2
_SMOOTHING = 0.3  # weight of the newest call in the cost per token's moving average


@dataclass(slots=True)
class _Input:
    id: int
    ids: list[int]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    computed: int = 0  # tokens of it earlier calls computed (a decoder's input, in chunks)
    queued_at: float = field(default_factory=time.monotonic)
    lost: int = 0  # calls of it lost with the shard group


class EmbeddingQueue:
    """Embeds token ids for a model's requests, in as few shard calls as its stall bound allows.

    `chunkable`: the model is a decoder, whose input may be computed in chunks across calls (an
    encoder's is computed whole). `recovery`: the batching loop's, which brings a lost group back
    (None: a failed call fails its inputs, and nothing waits)."""

    def __init__(self, client, *, decode_s: Callable[[], float | None], chunkable: bool = True,
                 decode_calls: Callable[[], int] | None = None,
                 max_call_tokens: int = MAX_CALL_TOKENS, recovery: ShardRecovery | None = None):
        self.client = client
        self.recovery = recovery
        self.decode_s = decode_s  # a decode step of the running batch; None: nothing decodes
        # decode calls answered so far: while a batch decodes, each Embed call waits for one
        # more, so that calls alternate with steps (the loop turns an Embed answer around
        # faster than the batcher a step's, and would otherwise send several per step)
        self.decode_calls = decode_calls
        self._seen_decode_calls = -1
        self.chunkable = chunkable
        self.max_call_tokens = max_call_tokens
        self.s_per_token: float | None = None  # what the last calls' forwards cost per token
        self._pending: deque[_Input] = deque()
        self._ids = itertools.count()
        self._drain: asyncio.Task | None = None
        self._refusal: Callable[[], RouterError] | None = None  # set once the model stops
        self._group = 0  # the recovery's restarts when the chunks computed so far were

    async def embed(self, inputs: list[list[int]]) -> list[numpy.ndarray]:
        """Each input's pooled vector (float32), in order, unnormalized."""
        if self._refusal is not None:
            raise self._refusal()
        items = [_Input(next(self._ids), ids) for ids in inputs]
        self._pending.extend(items)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        try:
            return list(await asyncio.gather(*(item.done for item in items)))
        finally:
            for item in items:  # a client that left: what was not begun is not computed
                item.done.cancel()

    def close(self, refusal: Callable[[], RouterError], error: RouterError) -> None:
        """Refuses later inputs with refusal(); those waiting get `error`."""
        self._refusal = refusal
        while self._pending:
            item = self._pending.popleft()
            if not item.done.done():
                item.done.set_exception(error)

    def call_tokens(self) -> int:
        """Tokens the next call may carry: a chunk's share of a step while a batch decodes."""
        decode_s = self.decode_s()
        if decode_s is None or not self.s_per_token:
            return self.max_call_tokens if decode_s is None else MIN_CHUNK_TOKENS
        fit = int(decode_s * STALL_RATIO / self.s_per_token)
        return max(MIN_EMBED_CHUNK_TOKENS, min(self.max_call_tokens, fit))

    def _next_call(self) -> list[tuple[_Input, int, int | None]]:
        """(input, tokens computed before, tokens now or None: to its end) of the next call.

        Whole inputs while they fit; then, on a decoder beside a decoding batch, a chunk of the
        next one, which ends the call (and stays first in line)."""
        budget, call, tokens = self.call_tokens(), [], 0
        split = self.chunkable and self.decode_s() is not None  # only a stream gains by it
        while self._pending and len(call) < MAX_CALL_INPUTS:
            item = self._pending[0]
            if item.done.done() and not item.computed:  # its request went away before it began
                self._pending.popleft()
                continue
            left, room = len(item.ids) - item.computed, budget - tokens
            if left <= room or (not call and not split):
                call.append((self._pending.popleft(), item.computed, None))
                tokens += left
            elif split and room >= MIN_EMBED_CHUNK_TOKENS:
                call.append((self._pending.popleft(), item.computed, room))
                break
            else:
                break
        return call

    async def _take_turn(self) -> None:
        """While a batch decodes, waits until it has taken a step since the last call.

        Or until two steps' time passed: a step that never comes holds nothing back."""
        decode_s = self.decode_s()
        if self.decode_calls is None or decode_s is None:
            return
        deadline = time.monotonic() + max(2 * decode_s, 0.01)
        while self.decode_calls() == self._seen_decode_calls and time.monotonic() < deadline:
            await asyncio.sleep(min(decode_s / 4, 0.005))
        self._seen_decode_calls = self.decode_calls()

    async def _run(self) -> None:
        while self._pending:
            await self._take_turn()  # the group may be lost or back meanwhile: checked after it
            recovery = self.recovery
            if recovery is not None and not recovery.healthy:
                await self._wait_for_shards(recovery.restarts, time.monotonic())
                continue
            restarts = recovery.restarts if recovery is not None else 0
            if restarts != self._group:  # a new group holds none of the chunks computed before
                self._group = restarts
                for item in self._pending:
                    item.computed = 0
            call = self._next_call()
            if not call:
                continue
            try:
                vectors, rejected, forward_ns = await self.client.embed(
                    [(item.id, item.ids, start, chunk) for item, start, chunk in call])
            except BaseException as err:  # the call's inputs fail with it; the others go on
                failure = GenerationError(f"embedding failed: {err}")
                if isinstance(err, ShardError) and await self._lost(restarts):
                    self._put_back(call, failure)
                    await self._wait_for_shards(restarts, time.monotonic())
                    continue
                for item, _, _ in call:
                    if not item.done.done():
                        item.done.set_exception(failure)
                if not isinstance(err, ShardError):
                    raise
                continue
            self._observe(forward_ns / 1e9, sum(chunk or len(item.ids) - start
                                                for item, start, chunk in call))
            for item, start, chunk in reversed(call):
                if item.id in rejected:
                    if not item.done.done():
                        item.done.set_exception(ValidationError(rejected[item.id]))
                elif chunk is not None:  # computed up to here: the rest comes first next
                    item.computed = start + chunk
                    self._pending.appendleft(item)
                elif item.done.done():
                    continue
                elif item.id in vectors:
                    item.done.set_result(vectors[item.id])
                else:
                    item.done.set_exception(ValidationError(
                        "the shards returned no embedding for this input"))

    async def _lost(self, restarts: int) -> bool:
        """Whether a call that failed was lost with the shard group (`restarts`: as it began)."""
        recovery = self.recovery
        return recovery is not None and (recovery.restarts != restarts or not recovery.healthy
                                          or await recovery.is_lost())

    def _put_back(self, call: list[tuple[_Input, int, int | None]], error: RouterError) -> None:
        """A lost call's inputs go first in line again, as often as a request is replayed.

        One lost that often fails with `error`: an input that kills the shards each time must
        not use up their restarts."""
        for item, _, _ in reversed(call):
            if item.done.done():
                continue
            item.lost += 1
            if item.lost >= self.recovery.policy.max_attempts:
                item.done.set_exception(error)
            else:
                self._pending.appendleft(item)

    async def _wait_for_shards(self, restarts: int, found_at: float) -> None:
        """Waits until the group lost after `restarts` restarts is back.

        Inputs that wait past the recovery's bound get its 503; those whose clients left are
        dropped. The batching loop notices the loss (within a second while idle) and brings the
        group back; `found_at`: when this queue found it lost, the wait's start until the loop
        has."""
        recovery = self.recovery
        while self._pending and recovery.restarts == restarts:
            now = time.monotonic()
            started = found_at if recovery.lost_since is None else recovery.lost_since
            for item in list(self._pending):
                error = (None if item.done.done()
                         else recovery.waiting_error(item.queued_at, started, now))
                if item.done.done() or error is not None:
                    self._pending.remove(item)
                    if error is not None:
                        item.done.set_exception(error)
            if self._pending:
                await recovery.back(restarts, within=RETRY_INTERVAL_S)

    def _observe(self, seconds: float, tokens: int) -> None:
        cost = seconds / max(tokens, 1)
        self.s_per_token = cost if self.s_per_token is None else (
            (1 - _SMOOTHING) * self.s_per_token + _SMOOTHING * cost)


@dataclass(slots=True)
class Embedded:
    vectors: list[numpy.ndarray]  # each input's pooled float32 vector, unnormalized, in order
    prompt_tokens: int  # the tokens computed, special tokens included


async def embed_inputs(served, inputs: list[str | list[int]], *, field: str,
                       truncate: bool = False, keep_last: int | None = None) -> Embedded:
    """The vectors of a request's inputs (texts or token ids) from the model `served`.

    An input longer than the model embeds is a 422, or with `truncate` cut to its first tokens
    (a text keeps its special tokens, as its tokenizer truncates); `keep_last` keeps an input's
    last tokens (vLLM's truncate_prompt_tokens)."""
    check_embeds(served)
    info, tokenizer = served.shard_info, served.tokenizer
    limit = info.max_embed_tokens or info.max_position_embeddings
    texts = [item for item in inputs if isinstance(item, str)]
    encoded = iter(await tokenizer.encode_many_async(texts) if texts else [])
    token_ids = []
    for index, item in enumerate(inputs):
        ids = next(encoded) if isinstance(item, str) else item
        if keep_last is not None:
            ids = ids[-keep_last:]
        if len(ids) > limit:
            if not truncate:
                raise ValidationError(f"`{field}`[{index}] has {len(ids)} tokens; this model "
                                      f"embeds at most {limit} (ask for truncation to cut it)",
                                      param=field)
            ids = (truncated(tokenizer.tokenizer, item, limit) if isinstance(item, str)
                   else ids[:limit])
        if info.vocab_size and max(ids) >= info.vocab_size:
            raise ValidationError(f"`{field}`[{index}] holds token id {max(ids)}, not below the "
                                  f"vocabulary's {info.vocab_size}", param=field)
        token_ids.append(ids)
    vectors = await served.embeddings.embed(token_ids)
    return Embedded(vectors, sum(len(ids) for ids in token_ids))


def check_embeds(served) -> None:
    """A 400 saying why, unless `served` serves embeddings."""
    if not served.embeds:
        why = ("start it with `embedding: true` (Jan's model setting) to serve them"
               if served.shard_info.pooling else "it cannot pool its hidden states")
        raise NotServedError(f"model {served.model_name!r} does not serve embeddings: {why}")


def truncated(tokenizer, text: str, limit: int) -> list[int]:
    """The text's first tokens, special tokens added around them, `limit` ids in all."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    processor = tokenizer.post_processor
    added = processor.num_special_tokens_to_add(False) if processor is not None else 0
    encoding.truncate(max(limit - added, 1))
    return tokenizer.post_process(encoding, None, True).ids
