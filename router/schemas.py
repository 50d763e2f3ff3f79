"""The internal request and event types every API module converts to and from."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy


class FinishReason(str, enum.Enum):
    """Why a generation ended, in TGI's JSON names.

    TGI's JSON names; the shard's FinishReason is numbered as the proto's (a table in
    router.shards.convert maps one to the other)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(slots=True)
class SamplingParams:
    """A request's sampling parameters, as validation leaves them.

    As validation leaves them; the shard has its own SamplingParams (the processes share no
    code, only the proto)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    # TGI's frequency penalty (its GenerateParameters' routes): the penalty times the token's
    # share of the sequence so far, not OpenAI's penalty per occurrence in the output
    frequency_by_share: bool = False
    presence_penalty: float = 0.0
    do_sample: bool = False
    seed: int = 0
    watermark: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit


@dataclass(slots=True)
class StoppingParams:
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a prompt over its placeholder tokens (the shard contract's Image)."""

    data: bytes  # the file as the client gave it, decoded once by the router to check it
    digest: bytes  # its SHA-256: blocks holding its tokens are cached under it
    token_offset: int  # its first placeholder token in input_ids
    token_count: int


@dataclass(slots=True)
class GenerateRequest:
    """A validated request: tokenised prompt plus every parameter the shards need."""

    inputs: str
    input_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    top_n_tokens: int = 0
    prefill_logprobs: bool = False
    skip_special_tokens: bool = True
    grammar: tuple[str, str] | None = None  # ("json" | "regex", schema text or pattern)
    # the prompt as float32 rows of the model's hidden size, in place of input_ids (then empty)
    input_embeds: bytes | None = None
    embeds_rows: int = 0
    logprob_token_ids: list[int] = field(default_factory=list)  # log p(id) at every position
    prefill_top_n_tokens: int = 0  # with prefill_logprobs: top tokens at every prompt position
    return_hidden_states: bool = False
    num_beams: int = 1  # > 1: beam search, whose whole answer comes with the last event
    length_penalty: float = 1.0
    adapter_id: str | None = None  # a loaded LoRA adapter's name; None: the base model
    images: list[PromptImage] = field(default_factory=list)  # in prompt order

    @property
    def input_length(self) -> int:
        return self.embeds_rows if self.input_embeds is not None else len(self.input_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here.

        It must when its ids are not all there is to know (embeddings), or what it asks of the
        prompt is not in the prefix cache's blocks."""
        return (self.prefill_logprobs or self.return_hidden_states
                or self.input_embeds is not None)


@dataclass(slots=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass(slots=True)
class FinalInfo:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None
    token_ids: list[int] | None = None  # beam search: the answer's ids (not streamed one by one)


@dataclass(slots=True)
class TokenEvent:
    """One generated token; the first also carries the prompt tokens, the last the final text."""

    token: Token
    top_tokens: list[Token] = field(default_factory=list)
    prefill: list[Token] | None = None
    final: FinalInfo | None = None
    token_ids_logprobs: list[float | None] = field(default_factory=list)  # per logprob_token_ids
    prefill_top_tokens: list[list[Token]] | None = None  # per prompt position (the first empty)
    prefill_token_ids_logprobs: list[list[float | None]] | None = None  # per prompt position
    hidden_states: numpy.ndarray | None = None  # float32 rows this step computed (the proto's)


@dataclass(slots=True)
class Timings:
    """time.monotonic() marks of one request's life."""

    started_at: float = 0.0
    queued_at: float = 0.0
    batched_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied, known once batched
