"""Beam search for one request, scored as `transformers` scores it.

With the KV blocks of its beams (copy on write, within the request's own blocks), and a step of
the search."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

log = logging.getLogger("tgi.shard.beams")

NEG_INF = -1.0e9  # transformers' "impossible" score


@dataclass(slots=True)
class BeamOptions:
    num_beams: int
    length_penalty: float = 1.0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(slots=True)
class Hypothesis:
    score: float
    token_ids: list[int]  # generated ids, the ending one included


@dataclass(slots=True)
class BeamSearch:
    """The running beams of one request and its finished hypotheses.

    Each step takes the log-probabilities of the k running beams' next tokens, keeps the best
    max(2, 1 + EOS ids) x k continuations (drawn without replacement when sampling), files the top
    k that end (an EOS id, or the length limit) as finished hypotheses scored sum /
    generated^penalty, continues the k best that do not, and stops once no running beam can beat
    the worst of k finished hypotheses (transformers' default `early_stopping=False` heuristic) or
    nothing can continue."""

    options: BeamOptions
    eos_token_ids: list[int]
    max_new_tokens: int
    generator: torch.Generator | None = None  # when sampling
    running: list[list[int]] = field(default_factory=lambda: [[]])  # generated ids per beam
    scores: torch.Tensor | None = None  # [beams] summed log-probabilities
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most num_beams
    improvable: bool = True
    done: bool = False

    @property
    def width(self) -> int:
        """Beams running now: one until the first step, then num_beams."""
        return len(self.running)

    def step(self, logprobs: torch.Tensor) -> list[int]:
        """One step of the search: logprobs [width, vocab] -> the parent of each new beam.

        logprobs are each running beam's next token's; a parent is an index into the old beams. Sets
        `done` when the search is over."""
        k = self.options.num_beams
        vocab = logprobs.shape[1]
        scores = self.scores if self.scores is not None else torch.zeros(1, device=logprobs.device)
        logprobs = self._warp(logprobs.float())
        accumulated = (logprobs + scores[:, None]).reshape(-1)
        keep = min(max(2, 1 + len(self.eos_token_ids)) * k, accumulated.numel())
        probabilities = torch.softmax(accumulated, dim=-1) if self.options.do_sample else None
        if probabilities is not None and bool(torch.isfinite(probabilities).all()) and int(
                (probabilities > 0).sum()) >= keep:
            index = torch.multinomial(probabilities, keep, generator=self.generator)
            top = accumulated[index]
        else:  # greedy, or a distribution too narrow to draw `keep` from: the best ones
            top, index = torch.topk(accumulated.nan_to_num(nan=-math.inf), keep)
        parents = (index // vocab).tolist()
        tokens = (index % vocab).tolist()
        top = top.tolist()
        generated = len(self.running[0]) + 1
        ends = [t in self.eos_token_ids or generated >= self.max_new_tokens for t in tokens]
        # the top k that end may join the finished ones (while improvement is possible)
        if self.improvable:
            for rank in range(min(k, keep)):
                if ends[rank]:
                    score = top[rank] / self._length_factor(generated)
                    self._finish(Hypothesis(score, self.running[parents[rank]] + [tokens[rank]]))
        # the best k that do not end continue (ended ones sink: transformers' -1e9)
        continuing = sorted(range(keep), key=lambda i: top[i] + (NEG_INF if ends[i] else 0.0),
                            reverse=True)[:k]
        new_parents = [parents[i] for i in continuing]
        self.running = [self.running[parents[i]] + [tokens[i]] for i in continuing]
        self.scores = torch.tensor([top[i] + (NEG_INF if ends[i] else 0.0) for i in continuing],
                                   device=logprobs.device)
        self.improvable = self.improvable and self._can_improve(generated)
        self.done = not self.improvable or all(ends)
        return new_parents

    def next_tokens(self) -> list[int]:
        return [beam[-1] for beam in self.running]

    def best(self) -> Hypothesis:
        """The best finished hypothesis (or, for a search cut short, the best running beam)."""
        return self.finished[0] if self.finished else Hypothesis(0.0, self.running[0])

    # ---- internals ----------------------------------------------------------------------------

    def _finish(self, hypothesis: Hypothesis) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier ones first
        del self.finished[self.options.num_beams:]

    def _can_improve(self, generated: int) -> bool:
        """transformers' early-stop heuristic: whether the search can still improve.

        The best running beam, at the current length, must beat the worst of num_beams finished
        hypotheses (always, while there are fewer)."""
        if len(self.finished) < self.options.num_beams:
            return True
        best_running = float(self.scores.max()) / self._length_factor(generated)
        return best_running > self.finished[-1].score

    def _length_factor(self, generated: int) -> float:
        return generated ** self.options.length_penalty

    def _warp(self, logprobs: torch.Tensor) -> torch.Tensor:
        """transformers' sampling warpers, applied to log-probabilities as its beam sampling does.

        Each keeps at least 1 + (EOS ids) tokens, so that a beam can always go on."""
        options = self.options
        if not options.do_sample:
            return logprobs
        keep = 1 + len(self.eos_token_ids)
        if options.temperature != 1.0:
            logprobs = logprobs / options.temperature
        if options.top_k:
            top_k = min(max(options.top_k, keep), logprobs.shape[1])
            kth = torch.topk(logprobs, top_k, dim=-1).values[:, -1:]
            logprobs = logprobs.masked_fill(logprobs < kth, -float("inf"))
        if options.top_p < 1.0:
            ordered, order = torch.sort(logprobs, dim=-1)  # ascending, as transformers' TopP
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - options.top_p
            remove[:, -keep:] = False
            logprobs = logprobs.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        return logprobs


class BeamBlocks:
    """The block tables of a request's beams over the blocks the router reserved for it.

    The router reserves enough for k whole sequences. Beams that descend from one parent share its
    blocks, counted per block; a shared block is copied only when a beam is about to write into it,
    and a reordering only rearranges the tables."""

    def __init__(self, table: list[int], spare: list[int], block_size: int):
        """The blocks of a request's beams, starting from the prompt's `table` and the `spare` ones.

        `table`: the prompt's blocks. They hold one reference more than the beams do, so a beam
        never writes into them in place nor hands them out again: they may be another's too (a
        request_id session's, until the call succeeds; the prefix cache's)."""
        self.block_size = block_size
        self.tables = [list(table)]
        self.free = list(reversed(spare))  # pop() hands out the lowest first
        self.refs = {block: 2 for block in table}

    def reorder(self, parents: list[int]) -> None:
        """New beam i continues old beam parents[i]: tables are copied by reference."""
        tables = [list(self.tables[p]) for p in parents]
        for table in tables:
            for block in table:
                self.refs[block] = self.refs.get(block, 0) + 1
        for table in self.tables:
            self._release(table)
        self.tables = tables

    def prepare_writes(self, position: int) -> list[tuple[int, int]]:
        """The (source, destination) blocks whose keys and values to copy before the forward.

        Makes the block each beam writes `position` into its own: a new block when the table ends
        before it, a copy of a shared one."""
        index = position // self.block_size
        copies = []
        for table in self.tables:
            if index == len(table):
                block = self.free.pop()
                self.refs[block] = 1
                table.append(block)
            elif self.refs[table[index]] > 1:
                source = table[index]
                block = self.free.pop()
                self.refs[source] -= 1
                self.refs[block] = 1
                table[index] = block
                copies.append((source, block))
        return copies

    def _release(self, table: list[int]) -> None:
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.free.append(block)


@dataclass(slots=True)
class Beams:
    search: BeamSearch
    blocks: BeamBlocks


def advance(beams: Beams, logits: torch.Tensor, request_id: int) -> list[int] | None:
    """One step of a request's search over its beams' logits [width, vocab].

    Once the search is over, it returns the ids of its best hypothesis (None before)."""
    try:
        parents = beams.search.step(torch.log_softmax(logits.float(), dim=-1))
        beams.blocks.reorder(parents)
    except Exception:  # this request's search ends with what it has; the batch goes on
        log.exception("beam search of request %d failed; it ends here", request_id)
        beams.search.done = True
    if not beams.search.done:
        return None
    best = beams.search.best().token_ids
    if not best:  # the search failed at its first step: the first beam's likeliest token
        best = [int(logits[0].argmax())]
    return best
