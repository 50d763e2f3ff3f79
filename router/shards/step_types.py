"""What the scheduler and the shards exchange, in the router's own types.

router.shards.convert turns these into the shard contract's messages and back; nothing else in the
router sees protobuf, so the scheduler's tests run on fakes that speak these types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from router.schemas import GenerateRequest, TokenEvent


@dataclass(slots=True)
class ShardRequest:
    """One request in a prefill: what to generate and where its keys and values go."""

    id: int
    request: GenerateRequest
    blocks: list[int]  # KV blocks the router's allocator gave it, prompt and new tokens
    cache_len: int = 0  # prompt tokens already in those blocks (a cached prefix, earlier chunks)
    chunk_len: int | None = None  # compute only this many prompt tokens (a chunk, not the last)


@dataclass(slots=True)
class NewBatch:
    id: int
    requests: list[ShardRequest]
    max_tokens: int  # KV tokens the batch may reach (prompts and every new token)
    max_blocks: int  # the longest block table in it


@dataclass(slots=True)
class PreparedBatch:
    """A NewBatch as the shard client will send it.

    `message` is opaque here (only the client reads it); `request_ids` are the requests that could
    be put into it."""

    request_ids: list[int]
    message: object = None


@dataclass(slots=True)
class CachedBatch:
    """A batch the shards hold between steps."""

    id: int
    request_ids: list[int]
    max_tokens: int = 0


class RequestFailedInShard(Exception):
    """The shard ended a request it could not go on with.

    The proto's Generation.error, such as a grammar its lexer gave up on: that request fails with
    the shard's reason."""


@dataclass(slots=True)
class Generation:
    """One request's step: its events, or why they could not be read back.

    Its events are one per token, several when speculation accepted drafts. A failure to read them
    back fails that request alone. The shard's Generation holds raw token runs; this one is already
    read."""

    request_id: int
    events: list[TokenEvent]
    error: Exception | None = None


@dataclass(slots=True)
class Rejection:
    """A request the step did not take; the others went on.

    `error` is set when it could not even be put into a message for the shards (a router bug), else
    the shard refused it."""

    request_id: int
    reason: str
    error: Exception | None = None


@dataclass(slots=True)
class StepTimings:
    forward_ns: int = 0
    decode_ns: int = 0
    concat_ns: int | None = None  # set when the step joined batches


@dataclass(slots=True)
class StepResult:
    """What one prefill or decode step produced; `batch` is None when nothing is left running.

    The shard's StepResult is the same step on the other side of the proto."""

    generations: list[Generation] = field(default_factory=list)
    batch: CachedBatch | None = None
    rejected: list[Rejection] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    draft_tokens: int = 0  # speculation: drafts the step verified
    accepted_tokens: int = 0  # and how many of them became tokens
    steps: int = 1  # decode steps the call took (several: ShardClient.decode's max_steps)
