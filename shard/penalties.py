"""The repetition, frequency and presence penalties: every API's, applied in one place.

Repetition (CTRL's, as TGI and transformers apply it): a token already in the prompt or output has
its logit divided by the penalty when positive, multiplied when negative. Presence (OpenAI's): the
penalty once for a token already in the output. Frequency in two forms, as the request's API
defines it (SamplingParams.frequency_by_share):
- OpenAI's (vLLM's, SGLang's): the penalty once per occurrence in the output;
- TGI's: the penalty times the token's share of the sequence so far, prompt and output (its
  occurrences / their length), so a value means far less than OpenAI's: 1.0 on a token that is
  a tenth of the sequence takes 0.1 off its logit.
"""
from __future__ import annotations

from typing import Protocol

import torch


class PenalisedRows(Protocol):
    """What the penalties read of a batch (shard.sampling's SamplingBatch)."""

    params: list  # each row's SamplingParams
    repetition_penalty: torch.Tensor  # a value per row
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor


def apply_penalties(scores: torch.Tensor, batch: PenalisedRows,
                    token_ids: list[tuple[list[int], list[int]]] | None) -> torch.Tensor:
    """`scores` [B, vocab] penalised for each row's (prompt ids, output ids) in `token_ids`."""
    if token_ids is None:
        raise ValueError("penalties need the prompt and output token ids of every row")
    vocab = scores.shape[1]
    device = scores.device
    seen = torch.zeros_like(scores, dtype=torch.bool)
    in_output = torch.zeros_like(scores, dtype=torch.bool)
    frequency = torch.zeros_like(scores)  # what each row's frequency_penalty is multiplied by
    for row, (prompt, output) in enumerate(token_ids):
        params = batch.params[row]
        if not params.has_penalty:
            continue
        if prompt or output:
            seen[row, torch.tensor(prompt + output, dtype=torch.long, device=device)] = True
        if output:
            in_output[row, torch.tensor(output, dtype=torch.long, device=device)] = True
        counted = prompt + output if params.frequency_by_share else output
        if counted and params.frequency_penalty:
            ids = torch.tensor(counted, dtype=torch.long, device=device).clamp_(0, vocab - 1)
            frequency[row].index_add_(0, ids, torch.ones_like(ids, dtype=frequency.dtype))
            if params.frequency_by_share:
                frequency[row] /= len(counted)
    penalty = batch.repetition_penalty.where(batch.repetition_penalty > 0,
                                             torch.ones_like(batch.repetition_penalty))
    penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
    scores = torch.where(seen, penalised, scores)
    scores = scores - batch.frequency_penalty * frequency
    scores = scores - batch.presence_penalty * in_output.to(scores.dtype)
    # a vanishing repetition penalty (1e-40) sends a logit past float32: the largest float keeps
    # the row a distribution (infinite ones would make every probability NaN); -inf stays masked
    return scores.nan_to_num(nan=float("-inf"), posinf=torch.finfo(scores.dtype).max,
                             neginf=float("-inf"))
