"""Which of a prefill's requests the shard admits.

Each check refuses one request's bad data (ids past the vocabulary, blocks it does not hold, a
grammar this vocabulary cannot follow) without failing the others."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shard.batch_state import NewRequest
from shard.grammar_matcher import GrammarFactory
from shard.images.admission import ImageSupport, check_images


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request must fit: the model's vocabulary, positions and hidden size, the KV blocks."""

    vocab_size: int
    hidden_size: int
    max_positions: int
    block_size: int
    activation_dtype: torch.dtype


def admit(requests: list[NewRequest], limits: ModelLimits, pool_blocks: int,
          grammars: GrammarFactory, images: ImageSupport | None = None
          ) -> tuple[list[NewRequest], list[tuple[int, str]]]:
    """The requests this shard can compute, and (id, why) of each it refuses.

    A refused one must not fail a running batch riding in the same forward either. A kept request's
    grammar is compiled here, once its last chunk comes; its images are preprocessed here (`images`:
    what the model takes; None: no images)."""
    kept, rejected = [], []
    for request in requests:
        try:
            check(request, limits, pool_blocks)
            check_images(request, images)
            if not request.is_partial_chunk:  # the last chunk compiles it
                request.matcher = (None if request.grammar is None
                                   else grammars.matcher(*request.grammar))
        except ValueError as err:
            rejected.append((request.id, str(err)))
            continue
        kept.append(request)
    return kept, rejected


def check(request: NewRequest, limits: ModelLimits, pool_blocks: int) -> None:
    """Raises ValueError saying why the request cannot be computed here."""
    needed = request.prompt_length + request.max_new_tokens - 1
    if needed > limits.max_positions:  # the rotary table ends there (on CUDA an index past it
        # is a device-side assert, which ends the process)
        raise ValueError(f"request {request.id} reaches position {needed - 1}, past "
                         f"the model's {limits.max_positions} positions")
    if needed > len(request.blocks) * limits.block_size:
        raise ValueError(f"request {request.id} needs {needed} KV slots but holds "
                         f"{len(request.blocks)} blocks of {limits.block_size}")
    # the decode kernel reads blocks through raw pointers: a stray id must stop here
    if request.blocks and not 0 <= min(request.blocks) <= max(request.blocks) < pool_blocks:
        raise ValueError(f"request {request.id} names a KV block outside the pool of "
                         f"{pool_blocks} blocks")
    _check_token_ids(request, limits.vocab_size)
    _check_embeds(request, limits)
    _check_beams(request, limits.block_size)


def _check_token_ids(request: NewRequest, vocab_size: int) -> None:
    # an id past the embedding table is an IndexError on CPU, a device assert on CUDA
    if request.input_ids and not 0 <= min(request.input_ids) <= max(
            request.input_ids) < vocab_size:
        raise ValueError(f"request {request.id} has token ids outside the model's "
                         f"vocabulary of {vocab_size}")
    if max(request.params.top_n_tokens, request.prefill_top_n_tokens) > vocab_size:
        raise ValueError(f"request {request.id} asks for more top tokens than the "
                         f"vocabulary of {vocab_size} holds")
    if request.params.logit_bias and max(request.params.logit_bias) >= vocab_size:
        raise ValueError(f"request {request.id} biases a token id outside the "
                         f"vocabulary of {vocab_size}")
    if request.logprob_token_ids and max(request.logprob_token_ids) >= vocab_size:
        raise ValueError(f"request {request.id} asks for the log-probability of a "
                         f"token id outside the vocabulary of {vocab_size}")


def _check_embeds(request: NewRequest, limits: ModelLimits) -> None:
    embeds = request.input_embeds
    if embeds is None:
        return
    if request.input_ids:
        raise ValueError(f"request {request.id} gives both token ids and input embeddings")
    if embeds.dim() != 2 or embeds.shape[1] != limits.hidden_size:
        raise ValueError(f"request {request.id}: input embeddings must be rows of "
                         f"{limits.hidden_size} values (the model's hidden size)")
    # in the model's dtype, as computed: float16 turns values past 65504 into infinities
    if not torch.isfinite(embeds.to(limits.activation_dtype)).all():
        raise ValueError(f"request {request.id}: input embeddings must be finite in "
                         f"{str(limits.activation_dtype).removeprefix('torch.')}")
    if request.prefill_logprobs:
        raise ValueError(f"request {request.id}: a prompt given as embeddings has no token "
                         "ids to score")


def _check_beams(request: NewRequest, block_size: int) -> None:
    if request.num_beams <= 1:
        return
    params = request.params
    if (request.grammar or request.stop_sequences or request.min_new_tokens
            or request.prefill_logprobs or request.return_hidden_states
            or request.logprob_token_ids or params.has_penalty or params.watermark
            or request.ignore_eos or request.input_embeds is not None):
        raise ValueError(f"request {request.id}: beam search takes no grammar, stop "
                         "sequences, min_new_tokens, penalties, watermark, ignore_eos, "
                         "prompt scores, hidden states or input embeddings")
    # every beam may hold a whole sequence, and the prompt's partial block stays aside
    per_beam = math.ceil((request.prompt_length + request.max_new_tokens - 1) / block_size)
    needed = request.num_beams * per_beam + 1
    if len(request.blocks) < needed:
        raise ValueError(f"request {request.id}: {request.num_beams} beams need {needed} KV "
                         f"blocks, it holds {len(request.blocks)}")
