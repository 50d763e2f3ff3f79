"""Batched next-token choice: each request's parameters as rows of tensors, one pass over the batch.

`sample` lists its steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.grammar_matcher import mask_disallowed
from shard.kernels import layer_ops
from shard.penalties import apply_penalties
from shard.noise_hash import seed_key
from shard.sampling_noise import draw
from shard.watermark import apply_watermark


@dataclass(slots=True)
class SamplingParams:
    """The router's SamplingParams (router/schemas.py) as the shard reads it from the proto.

    The two processes share no code, and the shard adds top_n_tokens, which its sampler computes."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    frequency_by_share: bool = False  # TGI's form (shard/penalties.py)
    presence_penalty: float = 0.0
    do_sample: bool = False
    seed: int = 0
    top_n_tokens: int = 0
    watermark: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@dataclass(slots=True)
class SamplingBatch:
    """Row-aligned sampling state of a batch; filter and concatenate keep rows in batch order."""

    params: list[SamplingParams]
    grammars: list  # an llguidance matcher per constrained row, else None
    seed_keys: torch.Tensor  # [B] int64: each row's seed as its draws read it (sampling_noise)
    temperature: torch.Tensor  # [B, 1]
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B, 1]
    typical_p: torch.Tensor  # [B, 1]
    min_p: torch.Tensor  # [B, 1]
    repetition_penalty: torch.Tensor  # [B, 1]
    frequency_penalty: torch.Tensor  # [B, 1]
    presence_penalty: torch.Tensor  # [B, 1]
    do_sample: torch.Tensor  # [B] bool
    flags: dict = field(default_factory=dict)
    # every row's logit_bias as (rows, ids, values) tensors, built once per batch rather than
    # once per step (a request may bias thousands of ids)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the sampling rows of a batch that also has greedy ones: only theirs draw noise
    sampling_rows: torch.Tensor | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device,
                    grammars: list | None = None) -> "SamplingBatch":
        if grammars is None:
            grammars = [None] * len(params)

        def column(name):
            return torch.tensor([[getattr(p, name)] for p in params], dtype=torch.float32,
                                device=device)

        batch = cls(
            params=list(params), grammars=list(grammars),
            seed_keys=torch.tensor([seed_key(p.seed) for p in params], dtype=torch.long,
                                   device=device),
            temperature=column("temperature"),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=column("top_p"), typical_p=column("typical_p"), min_p=column("min_p"),
            repetition_penalty=column("repetition_penalty"),
            frequency_penalty=column("frequency_penalty"),
            presence_penalty=column("presence_penalty"),
            do_sample=torch.tensor([p.do_sample for p in params], dtype=torch.bool, device=device),
        )
        batch.flags = _flags(params)
        batch.flags["grammar"] = any(g is not None for g in grammars)
        if batch.flags["logit_bias"]:
            batch.bias = _bias_tensors(params, device)
        if batch.flags["any_sample"] and not batch.flags["all_sample"]:
            batch.sampling_rows = torch.tensor([i for i, p in enumerate(params) if p.do_sample],
                                               dtype=torch.long, device=device)
        return batch

    def select(self, rows: list[int]) -> "SamplingBatch":
        return SamplingBatch.from_params([self.params[i] for i in rows], self.do_sample.device,
                                         [self.grammars[i] for i in rows])

    @staticmethod
    def concatenate(batches: list["SamplingBatch"]) -> "SamplingBatch":
        return SamplingBatch.from_params([p for b in batches for p in b.params],
                                         batches[0].do_sample.device,
                                         [g for b in batches for g in b.grammars])


def _flags(params: list[SamplingParams]) -> dict:
    sampling = [p for p in params if p.do_sample]
    return {
        "any_sample": bool(sampling),
        "all_sample": len(sampling) == len(params),
        "penalty": any(p.has_penalty for p in params),
        "watermark": any(p.watermark for p in params),
        "logit_bias": any(p.logit_bias for p in params),
        "temperature": any(p.temperature not in (0.0, 1.0) for p in sampling),
        "top_k": any(p.top_k > 0 for p in sampling),
        # known on the host: the top-k pass sizes itself without reading the device
        "max_top_k": max((p.top_k for p in sampling if p.top_k > 0), default=0),
        "top_p": any(0.0 < p.top_p < 1.0 for p in sampling),
        "typical_p": any(0.0 < p.typical_p < 1.0 for p in sampling),
        "min_p": any(p.min_p > 0.0 for p in sampling),
        "max_top_n": max((p.top_n_tokens for p in params), default=0),
    }


def needs_history(batch: SamplingBatch) -> bool:
    return batch.flags["penalty"] or batch.flags["watermark"]


@dataclass(slots=True)
class SampleOutput:
    next_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float
    top_ids: torch.Tensor | None  # [B, max_top_n] long
    top_logprobs: torch.Tensor | None  # [B, max_top_n] float
    scores: torch.Tensor  # [B, vocab] the scores the token was chosen from
    distribution: torch.Tensor | None = None  # their log-probabilities, once computed

    def log_distribution(self) -> torch.Tensor:
        """[B, vocab] the log-probabilities the token was drawn from."""
        if self.distribution is None:
            self.distribution = torch.log_softmax(self.scores, dim=-1)
        return self.distribution


def sample(logits: torch.Tensor, batch: SamplingBatch,
           token_ids: list[tuple[list[int], list[int]]] | None = None,
           banned: list[frozenset[int]] | None = None,
           positions: torch.Tensor | None = None) -> SampleOutput:
    """The choice of one token per row of logits [B, vocab].

    Steps, in order:
      0. logit_bias, then watermark (green-list bias, for the rows that ask);
      1. repetition penalty (prompt and output tokens), frequency and presence penalties (output
         tokens), then each constrained row's grammar mask, then the banned ids (min_new_tokens);
      2. for sampling rows only: temperature, top-k, top-p, typical-p, min-p;
      3. greedy rows take the argmax; sampling rows draw with noise keyed by their seed and the
         position of the token (sampling_noise), all in one pass;
      4. the chosen token's log-probability (log-softmax of the scores it was chosen from) and
         the top-n.
    A step is skipped when no row needs it, so a greedy batch costs one argmax and one
    log-softmax.

    `token_ids` gives (prompt ids, output ids) per row; it is needed only when a row has a penalty
    or a watermark (see `needs_history`). `banned`, per row, ids its token may not be (the
    end-of-sequence ones before min_new_tokens), unless they are all its grammar allows.
    `positions` [B]: the index each row's token takes in its sequence, which its draw is keyed by
    (None: 0). Nothing is read back to the host.
    """
    flags = batch.flags
    scores = logits.float()
    if flags["logit_bias"]:
        rows, ids, values = batch.bias
        scores = scores.index_put((rows, ids), values, accumulate=True)  # a new tensor
    if flags["watermark"]:
        rows = [i for i, p in enumerate(batch.params) if p.watermark]
        scores = apply_watermark(scores, rows, [(token_ids[i][0] + token_ids[i][1])[-1] for i in rows])
    if flags["penalty"]:
        scores = apply_penalties(scores, batch, token_ids)
    if flags["grammar"]:
        scores = mask_disallowed(scores, batch.grammars)
    if banned is not None and any(banned):
        scores = _ban(scores, banned, batch.grammars if flags["grammar"] else None,
                      owned=scores is not logits)
    if not flags["any_sample"] and not flags["max_top_n"]:
        # greedy: the argmax and its log-probability are all a plain step reads
        picked = layer_ops.greedy_pick(scores)
        if picked is not None:
            return SampleOutput(picked[0], picked[1], None, None, scores)
    if flags["any_sample"]:
        scores = _warp(scores, batch, flags)
    logprobs_all = torch.log_softmax(scores, dim=-1)
    next_ids = scores.argmax(dim=-1)
    if flags["any_sample"]:
        next_ids = _draw(logprobs_all, next_ids, batch, positions)
    logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    top_ids = top_logprobs = None
    if flags["max_top_n"] > 0:
        top_logprobs, top_ids = logprobs_all.topk(flags["max_top_n"], dim=-1)
    return SampleOutput(next_ids, logprobs, top_ids, top_logprobs, scores, logprobs_all)


def _ban(scores: torch.Tensor, banned: list[frozenset[int]], grammars: list | None,
         owned: bool) -> torch.Tensor:
    """The scores with -inf for each row's banned ids, unless that would leave the row nothing.

    A row they would leave with nothing has a grammar that allows only its end: the request ends
    there. In place on `scores` when `owned` (a tensor sample made), else on a copy: a step pays a
    few small writes, not a pass over the whole [B, vocab] scores."""
    vocab = scores.shape[1]
    pairs = [(row, token) for row, tokens in enumerate(banned) for token in tokens if token < vocab]
    if not pairs:
        return scores
    if not owned:
        scores = scores.clone()
    rows = torch.tensor([row for row, _ in pairs], device=scores.device)
    ids = torch.tensor([token for _, token in pairs], device=scores.device)
    kept = scores[rows, ids]
    scores.index_put_((rows, ids), torch.tensor(float("-inf"), device=scores.device))
    # only a grammar's mask can leave a row nothing but banned ids: such a row keeps them
    constrained = sorted({row for row, _ in pairs if grammars and grammars[row] is not None})
    if constrained:
        emptied = {row for row, empty in zip(
            constrained, torch.isneginf(scores[constrained]).all(dim=-1).tolist()) if empty}
        restore = torch.tensor([row in emptied for row, _ in pairs], device=scores.device)
        scores.index_put_((rows[restore], ids[restore]), kept[restore])
    return scores


def _bias_tensors(params: list[SamplingParams], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, ids, values) of every row's logit_bias."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    ids = [token for p in params for token in p.logit_bias]
    values = [value for p in params for value in p.logit_bias.values()]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _warp(scores: torch.Tensor, batch: SamplingBatch, flags: dict) -> torch.Tensor:
    """Temperature, top-k, top-p, typical-p and min-p, on sampling rows only."""
    sampling_rows = batch.do_sample.unsqueeze(1)
    warped = scores
    if flags["temperature"]:
        temperature = batch.temperature.where(batch.temperature > 0,
                                              torch.ones_like(batch.temperature))
        # from the row's largest score down: a tiny temperature (1e-45) then sends the others to
        # -inf, the limit it stands for (greedy), where dividing the scores themselves would
        # overflow them to inf and the probabilities to NaN; softmax is the same either way
        warped = (warped - warped.max(dim=-1, keepdim=True).values) / temperature
    if flags["top_k"]:
        warped = _top_k(warped, batch.top_k, flags["max_top_k"])
    if flags["top_p"]:
        warped = _top_p(warped, batch.top_p)
    if flags["typical_p"]:
        warped = _typical_p(warped, batch.typical_p)
    if flags["min_p"]:
        probs = warped.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p
        warped = warped.masked_fill(probs < threshold, float("-inf"))
    if flags["all_sample"]:
        return warped
    return torch.where(sampling_rows, warped, scores)


def _top_k(scores: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Each row with a top_k (> 0) keeps its top_k best scores; the others keep all.

    max_top_k: the largest top_k of a sampling row (a greedy row's scores are not used)."""
    largest = min(max_top_k, scores.shape[1])
    k = top_k.clamp(1, largest)
    kth = scores.topk(largest, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return scores.masked_fill((scores < kth) & (top_k > 0).unsqueeze(1), float("-inf"))


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    p = top_p.where((top_p > 0) & (top_p < 1), torch.ones_like(top_p))
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    # drop a token once the mass before it already reaches p; the most likely token always stays
    drop = (cumulative - sorted_scores.softmax(dim=-1)) >= p
    drop[:, 0] = False
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def _typical_p(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    p = typical_p.where((typical_p > 0) & (typical_p < 1), torch.ones_like(typical_p))
    logp = scores.log_softmax(dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp).nan_to_num().sum(dim=-1, keepdim=True)
    surprise_gap = (entropy + logp).abs()
    sorted_gap, order = surprise_gap.sort(dim=-1)
    cumulative = probs.gather(1, order).cumsum(dim=-1)
    drop = (cumulative - probs.gather(1, order)) >= p
    drop[:, 0] = False
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def _draw(logprobs: torch.Tensor, greedy_ids: torch.Tensor, batch: SamplingBatch,
          positions: torch.Tensor | None) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) keyed by seed and position.

    Every sampling row at once (sampling_noise.draw); greedy rows keep greedy_ids."""
    if positions is None:
        positions = torch.zeros_like(batch.seed_keys)
    return draw(logprobs, batch.seed_keys, positions, batch.sampling_rows, greedy_ids)
