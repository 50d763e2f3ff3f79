"""N-gram (prompt-lookup) drafts for speculative decoding.

A request's next tokens are guessed from its own text: when the last few tokens (its suffix) occurred
earlier in the prompt or the output, the tokens that followed them then are proposed now. The
engine verifies every draft in the same forward as the real next token and keeps the longest run the
model agrees with, so a guess costs a row of the forward and never changes the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# the longest suffix looked up first: a longer match predicts better, a shorter one matches more often
MAX_NGRAM = 3
MIN_NGRAM = 1


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (MIN_NGRAM <= n <= MAX_NGRAM) of a sequence last ended, kept up to date
    as the sequence grows: a lookup costs a few dictionary reads, not a scan of the sequence."""

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # positions whose n-grams are recorded

    def propose(self, ids: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix
        of `ids` that occurred before; [] when none did (or `count` is 0)."""
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


# A forward's cost grows about linearly with its rows: a + b x rows. This is a / b as measured on
# a CPU (benchmarks/engine_bench.py: 13.8 ms at 1 row, 25.6 at 16, 39.7 at 32 for SmolLM2 in
# bf16); on a GPU rows cost relatively less, and the rule below then drafts more willingly.
ROW_COST_RATIO = 16.0
# how fast a request's acceptance estimate follows its latest drafts
ACCEPTANCE_WEIGHT = 0.3


def acceptance_threshold(batch_rows: int, ratio: float = ROW_COST_RATIO) -> float:
    """The share of its drafts a request must be expected to get accepted for drafting to pay:
    a draft row costs b and yields its acceptance rate in tokens, while the step yields
    batch_rows tokens for a + b x batch_rows; it pays when rate > batch_rows / (a / b + rows)."""
    return batch_rows / (ratio + batch_rows)


@dataclass(slots=True)
class Drafter:
    """One request's drafts and how well they have done: it drafts while its acceptance estimate
    clears the step's threshold; otherwise it keeps checking, for free, whether its first draft
    token would have been right, so that a request that starts repeating itself drafts again."""

    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: float = 1.0  # estimated share of drafts accepted; optimistic until measured
    shadow: int | None = None  # the token it would have proposed first, this step

    def drafts(self, ids: list[int], count: int, threshold: float) -> list[int]:
        proposal = self.index.propose(ids, count)
        if self.acceptance >= threshold:
            self.shadow = None
            return proposal
        self.shadow = proposal[0] if proposal else None
        return []

    def observe(self, draft: list[int], chosen: list[int]) -> None:
        """Updates the estimate with the step's outcome: the draft verified (every chosen token
        but the last was an accepted draft token) or the shadow guess."""
        if draft:
            rate = (len(chosen) - 1) / len(draft)
        elif self.shadow is not None:
            rate = float(chosen[0] == self.shadow)
        else:
            return
        self.acceptance += ACCEPTANCE_WEIGHT * (rate - self.acceptance)
