"""What an engine step returns, as dataclasses convert.py maps to protobuf; how later steps add up.

The names differ from the protobuf messages they become (RequestOutput -> Generation, BatchInfo ->
CachedBatch, StepOutput -> PrefillResponse or DecodeResponse) and from the router's types read back
from those messages (router/shards/step_types.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.stopping import FinishReason


@dataclass(slots=True)
class TokenRun:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    is_special: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None
    token_ids: list[int] | None = None  # beam search: the best hypothesis, sent only at the end


@dataclass(slots=True)
class PromptScores:
    """What a prefill returns about the prompt's own positions, beyond its first token."""

    tokens: TokenRun | None = None  # log p(prompt token | earlier ones), with prefill_logprobs
    top_tokens: list[TokenRun] = field(default_factory=list)  # per position, prefill_top_n_tokens
    token_ids_logprobs: list[float] = field(default_factory=list)  # positions x logprob_token_ids


@dataclass(slots=True)
class RequestOutput:
    """What one request got from a step: its new tokens, and its end where it ended."""

    request_id: int
    tokens: TokenRun
    prompt: PromptScores | None = None
    generated_text: GeneratedText | None = None
    top_tokens: list[TokenRun] = field(default_factory=list)
    token_ids_logprobs: list[float] = field(default_factory=list)  # tokens x logprob_token_ids
    hidden_states: torch.Tensor | None = None  # [rows, hidden] float32 on the CPU
    error: str | None = None  # the request cannot go on: it ends here, failed with this


@dataclass(slots=True)
class BatchInfo:
    """A batch the engine keeps between steps, as the router sees it: its id and its requests."""

    id: int
    request_ids: list[int]
    max_tokens: int
    current_tokens: int


@dataclass(slots=True)
class StepOutput:
    """One prefill or decode call's outputs: each request's, the batch kept, times and counts."""

    generations: list[RequestOutput]
    batch: BatchInfo | None
    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0
    concat_ns: int | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (request id, why), Prefill only
    draft_tokens: int = 0  # speculation: draft tokens this step verified
    accepted_tokens: int = 0  # and how many of them the model agreed with
    steps: int = 1  # decode steps the call took (Engine.decode's max_steps)


@dataclass(slots=True)
class WarmupResult:
    num_blocks: int
    block_size: int

    @property
    def max_supported_total_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size  # block 0 pads block tables: never handed out


def extend(generation: RequestOutput, more: RequestOutput) -> None:
    """Appends a later position's token (and all it carries) to a request's generation."""
    for name in ("ids", "logprobs", "texts", "is_special"):
        getattr(generation.tokens, name).extend(getattr(more.tokens, name))
    generation.top_tokens += more.top_tokens
    generation.token_ids_logprobs += more.token_ids_logprobs
    if more.hidden_states is not None:
        generation.hidden_states = torch.cat([generation.hidden_states, more.hidden_states])
    generation.generated_text = more.generated_text


def after_steps(earlier: StepOutput, later: StepOutput) -> StepOutput:
    """`later`, the next step of the same batch, counting `earlier`'s steps and times."""
    later.forward_ns += earlier.forward_ns
    later.decode_ns += earlier.decode_ns
    later.total_ns += earlier.total_ns
    later.steps += earlier.steps
    if later.concat_ns is None:  # the call's first step merged its batches
        later.concat_ns = earlier.concat_ns
    return later


def merge_steps(earlier: StepOutput, later: StepOutput) -> StepOutput:
    """`earlier` followed by `later`, the next step of the same batch, as one step's outputs.

    Each request's tokens (with all they carry) in order, the last step's batch and finish."""
    generations = {g.request_id: g for g in earlier.generations}
    for step in later.generations:
        if step.request_id in generations:
            extend(generations[step.request_id], step)
        else:
            earlier.generations.append(step)
    later.generations = earlier.generations
    return after_steps(earlier, later)
