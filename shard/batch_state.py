"""Per-request and per-batch state kept on the shard between steps.

A new batch, filter, concatenate and sampling a batch's next tokens are functions over it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shard.beams import BeamBlocks, BeamOptions, Beams, BeamSearch
from shard.detokenizer import DetokenizerState
from shard.sampling import SampleOutput, SamplingBatch, SamplingParams, needs_history, sample
from shard.speculation import Drafter
from shard.stopping import FinishReason, StopCriteria


@dataclass(slots=True)
class PromptImage:
    """One image of a prompt, over its placeholder tokens (proto Request.images)."""

    data: bytes  # the file as the client gave it
    offset: int  # the prompt position of its first placeholder token
    count: int  # its placeholder tokens
    pixels: torch.Tensor | None = None  # preprocessed at admission, when its chunk computes it
    # (rows, columns) of its tokens, where they depend on its size (Qwen2.5-VL's), at admission
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.count


@dataclass(slots=True)
class NewRequest:
    """A request as the router sends it in a Prefill."""

    id: int
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    prefill_logprobs: bool = False
    blocks: list[int] = field(default_factory=list)
    cache_len: int = 0
    skip_special_tokens: bool = True
    grammar: tuple[str, str] | None = None  # (kind, value) of a constrained request
    chunk_len: int | None = None  # prompt tokens to compute from cache_len; None: all the rest
    matcher: object | None = None  # its grammar compiled against the vocabulary, before the forward
    input_embeds: torch.Tensor | None = None  # [prompt length, hidden] given in place of input_ids
    logprob_token_ids: list[int] = field(default_factory=list)  # log p(id) at every position
    prefill_top_n_tokens: int = 0  # with prefill_logprobs: top tokens at every prompt position
    return_hidden_states: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    adapter: str | None = None  # a loaded LoRA adapter's name; None: the base model
    adapter_slot: int = -1  # its slot in the model's AdapterSet, once admitted
    images: list[PromptImage] = field(default_factory=list)  # in prompt order
    rope_delta: int = 0  # what decode positions fall behind lengths by (shard.models.mrope)

    @property
    def prompt_length(self) -> int:
        return len(self.input_ids) if self.input_embeds is None else self.input_embeds.shape[0]

    @property
    def is_partial_chunk(self) -> bool:
        return self.chunk_len is not None and self.cache_len + self.chunk_len < self.prompt_length

    @property
    def computes_every_position(self) -> bool:
        """Whether the prefill must return every prompt position, not only the last."""
        return self.prefill_logprobs or self.return_hidden_states


@dataclass(slots=True)
class RequestState:
    id: int
    prompt_ids: list[int]
    all_ids: list[int]  # prompt then generated ids
    blocks: list[int]
    stop: StopCriteria
    detok: DetokenizerState
    skip_special_tokens: bool
    text: list[str] = field(default_factory=list)  # pieces streamed so far
    finish_reason: FinishReason | None = None
    logprob_token_ids: list[int] = field(default_factory=list)
    return_hidden_states: bool = False
    beams: Beams | None = None  # a beam-search request: its beams and their blocks
    drafter: Drafter | None = None  # with speculation: its n-gram drafts and how they fare
    adapter_slot: int = -1  # the LoRA adapter every forward of it applies (-1: none)
    rope_delta: int = 0  # its positions are its lengths plus this (shard.models.mrope)

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids):]


@dataclass(slots=True)
class Batch:
    """Requests decoding together; tensors are row-aligned with `requests`."""

    id: int
    requests: list[RequestState]
    block_tables: torch.Tensor  # [B, max_blocks] long, rows padded with block 0
    seq_lens: torch.Tensor  # [B] long: tokens with KV in the cache (= position of the next input)
    next_input_ids: torch.Tensor  # [B] long: the last sampled token of each request
    sampling: SamplingBatch

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]

    @property
    def num_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    def adapter_slots(self, rows_per_request: list[int] | None = None) -> torch.Tensor | None:
        """The LoRA slot of each forward row, or None when no request has an adapter.

        A request's slot is repeated over its `rows_per_request` rows (beams, draft tokens)."""
        slots = [r.adapter_slot for r in self.requests]
        if all(slot < 0 for slot in slots):
            return None
        if rows_per_request is not None:
            slots = [slot for slot, n in zip(slots, rows_per_request) for _ in range(n)]
        return torch.tensor(slots, dtype=torch.long, device=self.seq_lens.device)

    def rope_deltas(self, rows_per_request: list[int] | None = None) -> torch.Tensor | None:
        """Each forward row's position minus its length, or None when every one is 0.

        Repeated over each request's `rows_per_request` rows, as adapter_slots."""
        deltas = [r.rope_delta for r in self.requests]
        if not any(deltas):
            return None
        if rows_per_request is not None:
            deltas = [delta for delta, n in zip(deltas, rows_per_request) for _ in range(n)]
        return torch.tensor(deltas, dtype=torch.long, device=self.seq_lens.device)


def new_batch(batch_id: int, requests: list[NewRequest], device: torch.device, *,
              eos_token_ids: frozenset[int], block_size: int, speculate: int) -> Batch:
    """The state of admitted requests, as their prefill starts it."""
    states = [_request_state(r, device, eos_token_ids, block_size, speculate) for r in requests]
    return Batch(
        id=batch_id, requests=states,
        block_tables=block_table_tensor([r.blocks for r in requests], device),
        seq_lens=torch.tensor([r.prompt_length for r in requests], dtype=torch.long,
                              device=device),
        next_input_ids=torch.zeros(len(requests), dtype=torch.long, device=device),
        sampling=SamplingBatch.from_params(
            [r.params for r in requests], device,
            grammars=[r.matcher for r in requests]),
    )


def _request_state(request: NewRequest, device: torch.device, eos_token_ids: frozenset[int],
                   block_size: int, speculate: int) -> RequestState:
    stop = StopCriteria(
        max_new_tokens=request.max_new_tokens,
        eos_token_ids=eos_token_ids | frozenset(request.stop_token_ids),
        stop_sequences=list(request.stop_sequences), ignore_eos=request.ignore_eos,
        min_new_tokens=request.min_new_tokens)
    return RequestState(id=request.id, prompt_ids=list(request.input_ids),
                        all_ids=list(request.input_ids), blocks=list(request.blocks), stop=stop,
                        detok=DetokenizerState.start(len(request.input_ids)),
                        skip_special_tokens=request.skip_special_tokens,
                        logprob_token_ids=list(request.logprob_token_ids),
                        return_hidden_states=request.return_hidden_states,
                        beams=_beams(request, device, eos_token_ids, block_size),
                        drafter=Drafter() if speculate else None,
                        adapter_slot=request.adapter_slot, rope_delta=request.rope_delta)


def _beams(request: NewRequest, device: torch.device, eos_token_ids: frozenset[int],
           block_size: int) -> Beams | None:
    if request.num_beams <= 1:
        return None
    params = request.params
    generator = None
    if params.do_sample:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    options = BeamOptions(request.num_beams, request.length_penalty, params.do_sample,
                          params.temperature, params.top_k, params.top_p)
    search = BeamSearch(options, sorted(eos_token_ids), request.max_new_tokens, generator)
    written = math.ceil(request.prompt_length / block_size)  # the prompt's blocks
    return Beams(search, BeamBlocks(request.blocks[:written], request.blocks[written:],
                                    block_size))


def sample_batch(logits: torch.Tensor, batch: Batch,
                 positions: torch.Tensor | None = None) -> SampleOutput:
    """Each row's next token from logits [B, vocab].

    With what its request's sampling reads of its state: the ids a penalty or watermark counts, the
    ids its stop criteria ban, and the position its token takes, which keys a sampling row's draw
    (`positions`, else seq_lens: where the token of a prefill, or of a step that has counted its
    input, goes)."""
    history = None
    if needs_history(batch.sampling):
        history = [(r.prompt_ids, r.output_ids) for r in batch.requests]
    banned = [state.stop.banned_ids() for state in batch.requests]
    return sample(logits, batch.sampling, history, banned if any(banned) else None,
                  batch.seq_lens if positions is None else positions)


def block_table_tensor(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(b) for b in blocks), default=1) or 1
    rows = [b + [0] * (width - len(b)) for b in blocks]
    return torch.tensor(rows, dtype=torch.long, device=device)


def filter_batch(batch: Batch, request_ids: list[int]) -> Batch:
    """Keeps the listed requests in the listed order; raises KeyError for an id not in the batch."""
    position = {rid: i for i, rid in enumerate(batch.request_ids)}
    missing = [rid for rid in request_ids if rid not in position]
    if missing:
        raise KeyError(f"requests {missing} are not in batch {batch.id}")
    rows = [position[rid] for rid in request_ids]
    index = torch.tensor(rows, dtype=torch.long, device=batch.seq_lens.device)
    requests = [batch.requests[i] for i in rows]
    width = max(len(r.blocks) for r in requests)
    return Batch(
        id=batch.id, requests=requests,
        block_tables=batch.block_tables.index_select(0, index)[:, :width].contiguous(),
        seq_lens=batch.seq_lens.index_select(0, index),
        next_input_ids=batch.next_input_ids.index_select(0, index),
        sampling=batch.sampling.select(rows),
    )


def concatenate_batches(batches: list[Batch]) -> Batch:
    """One batch holding every request of `batches` in order; it keeps the first batch's id."""
    width = max(b.block_tables.shape[1] for b in batches)
    tables = [torch.nn.functional.pad(b.block_tables, (0, width - b.block_tables.shape[1]))
              for b in batches]
    return Batch(
        id=batches[0].id,
        requests=[r for b in batches for r in b.requests],
        block_tables=torch.cat(tables),
        seq_lens=torch.cat([b.seq_lens for b in batches]),
        next_input_ids=torch.cat([b.next_input_ids for b in batches]),
        sampling=SamplingBatch.concatenate([b.sampling for b in batches]),
    )
