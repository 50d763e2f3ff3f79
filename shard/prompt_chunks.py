"""What the earlier chunks of a prompt whose every position is asked for computed.

A request with prefill log-probabilities or hidden states is prefilled in chunks like any long
prompt, so that the streams beside it keep going. Each partial chunk scores its rows at once
(a chunk's full logits are vocabulary-wide: never kept) and keeps its hidden states; the last
chunk's answer joins them. The router prefills one long prompt at a time, so the engine holds at
most one: a chunk of another prompt replaces it (its request was cancelled between two chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.batch_state import NewRequest
from shard.generations import Vocabulary, add_scores, chunk_scores, skipped_positions
from shard.outputs import PromptScores


@dataclass(slots=True)
class PromptSoFar:
    """The scores and hidden states of one prompt's positions up to `end`."""

    request_id: int
    end: int  # prompt positions computed
    scores: PromptScores | None  # with prefill_logprobs
    hidden: list[torch.Tensor] = field(default_factory=list)  # with return_hidden_states

    def continues(self, request: NewRequest) -> bool:
        """Whether `request`'s chunk is the next of this prompt."""
        return self.request_id == request.id and self.end == request.cache_len


def after_chunk(held: PromptSoFar | None, request: NewRequest, logits: torch.Tensor | None,
                hidden: torch.Tensor, vocab: Vocabulary) -> PromptSoFar:
    """`held` with a partial chunk's rows added (a fresh record for another prompt's chunk)."""
    if held is None or not held.continues(request):
        held = PromptSoFar(request.id, request.cache_len,
                           skipped_positions(request, request.cache_len)
                           if request.prefill_logprobs else None)
    if held.scores is not None:
        add_scores(held.scores, chunk_scores(request, logits, request.cache_len, vocab,
                                             is_last=False))
    if request.return_hidden_states:
        held.hidden.append(hidden.clone())  # a view would keep the whole forward's rows
    held.end = request.cache_len + request.chunk_len
    return held


def with_earlier(held: PromptSoFar | None, request: NewRequest,
                 hidden: torch.Tensor | None) -> torch.Tensor | None:
    """The last chunk's hidden states after those of the prompt's earlier chunks."""
    if hidden is None or held is None or not held.continues(request) or not held.hidden:
        return hidden
    return torch.cat([*held.hidden, hidden])
