"""How many tokens of a long prompt to prefill between two decode steps.

A fixed token budget stalls the running streams for however long that many tokens take on this
machine. Sizing each chunk from what the last steps cost instead bounds the stall: a step that carries
a chunk takes about (1 + ratio) times a plain decode step, on any hardware and at any batch size,
and a prompt with nobody decoding beside it still goes in budget-sized chunks.

The ratio is a share (`stall_ratio`): a prompt's chunks add half a decode step beside one decoding
stream and a quarter beside more (half of what one more stream would add, down to a floor, so that
with many streams a long prompt still advances). Streams already answering go first: one stream
beside a client that sends long prompts back to back runs at two thirds of its speed alone, two
at four fifths; a long prompt beside a few streams waits longer for its first token.

"Nobody decoding" means for a while (RECENT_DECODE_S), not at this instant: clients that send
requests back to back leave gaps of a few milliseconds between one answer and their next request,
and a budget-sized chunk started in such a gap (about a second on a CPU) made the next request wait
it out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

STALL_RATIO = 0.5  # a chunk may take half a decode step of the running batch...
MIN_STALL_RATIO = 0.25  # ...or a share of it with several streams decoding, never under this
# The first chunk of a prompt measures what its tokens cost: a batch of short prompts is no guide,
# since a chunk's attention reads its whole cached context.
FIRST_CHUNK_TOKENS = 32
MIN_CHUNK_TOKENS = 16  # below this, per-forward overhead dominates and the prompt barely advances
_SMOOTHING = 0.3  # weight of the newest decode step in the moving average
# how long after its last decode step a batch still sizes chunks, as if running
RECENT_DECODE_S = 1.0


@dataclass(slots=True)
class DecodeCost:
    """Moving average of a decode step of the running batch, as the router sees it."""

    seconds: float | None = None
    at: float | None = None  # time.monotonic() of the last step observed

    def observe(self, seconds: float, now: float | None = None) -> None:
        self.seconds = (seconds if self.seconds is None
                        else (1 - _SMOOTHING) * self.seconds + _SMOOTHING * seconds)
        self.at = time.monotonic() if now is None else now

    def for_chunk(self, decoding: bool, now: float | None = None) -> float | None:
        """The decode step a chunk is sized against; None: the whole budget, nothing decodes."""
        if decoding:
            return self.seconds
        if self.at is None or (time.monotonic() if now is None else now) - self.at > \
                RECENT_DECODE_S:
            return None
        return self.seconds


def stall_ratio(decoding_rows: int) -> float:
    """What a chunk may add to a decode step of `decoding_rows` streams, as a share of that step."""
    return max(MIN_STALL_RATIO, STALL_RATIO / max(1, decoding_rows))


def chunk_tokens(remaining: int, budget: int, *, decode_s: float | None,
                 chunk_s_per_token: float | None, ratio: float = STALL_RATIO) -> int:
    """Tokens for the next chunk of a prompt with `remaining` tokens left to prefill.

    decode_s: a decode step of the running batch (None when nothing decodes);
    chunk_s_per_token: what the previous chunk of this prompt cost per token (None before the first);
    ratio: what the chunk may add to that step, as a share of it (`stall_ratio`).
    """
    size = min(remaining, budget)
    if decode_s is None:
        return size
    if not chunk_s_per_token:
        return min(size, FIRST_CHUNK_TOKENS)
    affordable = int(ratio * decode_s / chunk_s_per_token)
    return min(size, max(MIN_CHUNK_TOKENS, affordable))
