"""N-gram (prompt-lookup) drafts for speculative decoding.

A request's next tokens are guessed from what followed its latest suffix earlier in its own text,
and drafted as far as they are worth a row of the forward each (shard.speculative_step verifies
them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# the longest suffix looked up first: a longer match predicts better, a shorter one matches more often
MAX_NGRAM = 3
MIN_NGRAM = 1


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (MIN_NGRAM <= n <= MAX_NGRAM) of a sequence last ended.

    Kept up to date as the sequence grows: a lookup costs a few dictionary reads, not a scan of the
    sequence."""

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # positions whose n-grams are recorded

    def propose(self, ids: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of a suffix of `ids`.

        The suffix looked up is the longest one of `ids` that occurred before; [] when none did, or
        when `count` is 0."""
        if count <= 0:
            return []
        # the n-grams ending at the last token are recorded only on the next call: the suffix
        # must match an earlier occurrence, not itself
        last = len(ids) - 1
        for end in range(self.indexed, last):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                self.last_end[tuple(ids[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(MAX_NGRAM, len(ids)), MIN_NGRAM - 1, -1):
            end = self.last_end.get(tuple(ids[len(ids) - n:]))
            if end is not None:
                return ids[end + 1:end + 1 + count]
        return []


# What a step costs: a + b x rows, plus, when a request drafts, a round of choosing tokens per
# drafted position (sampling, detokenising and stop checks for the requests still in the run).
# This is a / b with that round counted as rows: lower than the forward's own ratio, which made
# large batches draft where it did not pay (benchmarks/RESULTS.md).
ROW_COST_RATIO = 6.0
# How much of a request's record each new step keeps: its estimate follows about its last
# 1 / (1 - RECORD_DECAY) steps. Before any record, a guess is taken to hold with PRIOR_HITS /
# PRIOR_CHECKS, as if that many guesses had been checked.
RECORD_DECAY = 0.8
PRIOR_HITS, PRIOR_CHECKS = 1.0, 2.0


def acceptance_threshold(batch_rows: int, ratio: float = ROW_COST_RATIO) -> float:
    """The chance of being accepted a draft token needs for its row to pay.

    A row costs b and yields that chance in tokens, while the step yields batch_rows tokens for
    a + b x batch_rows; it pays when the chance exceeds batch_rows / (a / b + batch_rows)."""
    return batch_rows / (ratio + batch_rows)


@dataclass(slots=True)
class Drafter:
    """One request's drafts and how well its guesses have done.

    A draft's i-th token is accepted only if the i - 1 before it were, so with a guess holding with
    chance p it is accepted with chance p^i: the request drafts as many tokens as keep p^i above the
    step's threshold (none when even the first does not), and still checks, for free, whether the
    guess it did not send would have held, so that a request that starts repeating itself drafts
    again."""

    index: NgramIndex = field(default_factory=NgramIndex)
    hits: float = 0.0  # guesses that held, decayed step by step
    checks: float = 0.0  # guesses checked, decayed alike
    shadow: int | None = None  # the first token it would have proposed, when it proposed none

    @property
    def hit_rate(self) -> float:
        return (self.hits + PRIOR_HITS) / (self.checks + PRIOR_CHECKS)

    def drafts(self, ids: list[int], count: int, threshold: float) -> list[int]:
        proposal = self.index.propose(ids, count)
        length, chance = 0, self.hit_rate
        while length < len(proposal) and chance ** (length + 1) > threshold:
            length += 1
        self.shadow = proposal[0] if proposal and not length else None
        return proposal[:length]

    def observe(self, draft: list[int], chosen: list[int]) -> int:
        """The record of one step's outcome; returns how many draft tokens were accepted.

        The draft's tokens are checked until the first that did not hold, or the unsent guess.
        Accepted tokens were chosen as drafted, the last of them too when the request stopped on it.
        """
        accepted = 0
        if draft:
            while accepted < min(len(draft), len(chosen)) and draft[accepted] == chosen[accepted]:
                accepted += 1
            hits, checks = accepted, min(accepted + 1, len(draft))
        elif self.shadow is not None:
            hits, checks = int(chosen[0] == self.shadow), 1
        else:
            return 0
        self.hits = self.hits * RECORD_DECAY + hits
        self.checks = self.checks * RECORD_DECAY + checks
        return accepted
