"""How many tokens of a long prompt to prefill between two decode steps.

A fixed token budget stalls the running streams for however long that many tokens take on this
machine. Sizing each chunk from what the last steps cost instead bounds the stall: a step that carries
a chunk takes at most (1 + STALL_RATIO) times a plain decode step, on any hardware and at any batch
size, and a prompt with nobody decoding beside it still goes in budget-sized chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

STALL_RATIO = 1.0  # a chunk may take as long as one decode step of the running batch
MIN_CHUNK_TOKENS = 16  # below this, per-forward overhead dominates and the prompt barely advances
_SMOOTHING = 0.3  # weight of the newest observation in the moving averages


@dataclass(slots=True)
class StepCosts:
    """Moving averages of the shards' step latencies, as the router sees them."""

    decode_s: float | None = None  # one decode step of the running batch
    prefill_s_per_token: float | None = None  # the most recent prefills and chunks

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = _average(self.decode_s, seconds)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.prefill_s_per_token = _average(self.prefill_s_per_token, seconds / tokens)


def chunk_tokens(remaining: int, budget: int, *, decoding: bool, costs: StepCosts) -> int:
    """Tokens for the next chunk of a prompt with `remaining` tokens left to prefill."""
    size = min(remaining, budget)
    if not decoding or costs.decode_s is None or not costs.prefill_s_per_token:
        return size
    affordable = int(STALL_RATIO * costs.decode_s / costs.prefill_s_per_token)
    return min(size, max(MIN_CHUNK_TOKENS, affordable))


def _average(previous: float | None, new: float) -> float:
    return new if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * new
