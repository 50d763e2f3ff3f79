"""The scheduling policy, pure: who joins the running batch, how large a prompt's next chunk is.

How many new requests may join, by TGI's waiting_served_ratio / max_waiting_tokens rules; the chunks
are a long prompt's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from router.scheduler.active_request import ActiveRequest
from router.kv.prefix_cache import outside_images
from router.scheduler.chunk_sizing import STALL_RATIO, chunk_tokens, stall_ratio

# A decode call of several steps holds back a request arriving meanwhile and hands the streams
# their tokens in bursts: several are asked only while nothing waits, and no more than fit in
# this long at the measured step cost (why 50 ms: benchmarks/RESULTS.md, "Several decode steps
# a call").
MULTI_STEP_CALL_S = 0.05


@dataclass(slots=True)
class SchedulingLimits:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_batch_size: int | None
    max_decode_steps: int = 1  # decode steps one call may run (--max-decode-steps-per-call)
    # each step of such a call streamed as it ends (DecodeStream), rather than with the call's
    # last: for shards on CUDA, whose CPU idles while a step computes; on the CPU the router's and
    # the server's work on each step would take cores from the step itself (streamed, one stream
    # of SmolLM2 on 2 cores was as slow as with a call a step: benchmarks/RESULTS.md)
    stream_decode_steps: bool = False

    def join_bounds(self, running_size: int, waited_tokens: int, *, chunking: bool = False
                    ) -> tuple[int | None, int | None]:
        """(min, max) new requests for the next prefill.

        While the running batch has passed fewer than max_waiting_tokens tokens (per
        request: one a step, or several with speculation) since the last prefill, a prefill
        that interrupts it must bring at least waiting_served_ratio × its size;
        max_batch_size caps the sum. With shards that chunk (TGI's rule) there is no
        minimum: a new request's prefill carries the running batch's step, so it costs them
        no step of their own and joins as soon as it fits.
        """
        min_size = None
        if running_size and not chunking and waited_tokens < self.max_waiting_tokens:
            min_size = max(1, math.floor(running_size * self.waiting_served_ratio))
        max_size = None
        if self.max_batch_size is not None:
            max_size = max(self.max_batch_size - running_size, 0)
        return min_size, max_size

    def decode_steps(self, step_s: float | None, *, waiting: bool) -> int:
        """Decode steps the next call may run, `step_s` what a step of this batch took last.

        One while anything waits (a queued request or a long prompt's next chunk) or before
        a step was measured; else as many as fit in MULTI_STEP_CALL_S, up to
        max_decode_steps (the batcher takes one step after every prefill, so a batch that
        grew is timed before it takes more). Each call costs a round trip to the shards and
        back through the router, at small batches a sizeable part of a step.
        """
        if self.max_decode_steps <= 1 or waiting or not step_s:
            return 1
        return max(1, min(self.max_decode_steps, int(MULTI_STEP_CALL_S / step_s)))

    def join_reason(self, waited_tokens: int, *, chunking: bool = False) -> str:
        """TGI's tgi_batch_concat label for a prefill that joins a running batch."""
        if chunking:
            return "chunking"
        return "wait_exceeded" if waited_tokens >= self.max_waiting_tokens else "backpressure"


@dataclass(slots=True)
class ChunkedPrefill:
    """A long prompt computed one chunk between two decode steps."""

    item: ActiveRequest
    next_start: int  # prompt tokens already in the cache
    s_per_token: float | None = None  # what the previous chunk cost, to size the next
    # time.monotonic() before which the next chunk waits while others decode: a chunk of even
    # MIN_CHUNK_TOKENS can add several decode steps to its step (a prefill forward's own cost),
    # and the decode steps in between bring the average back to the stall ratio
    not_before: float = 0.0
    ratio: float = STALL_RATIO  # the stall ratio the last chunk was sized for
    _queue_turn: bool = False

    def queue_turn(self) -> bool:
        """Whether queued prompts may go before the next chunk: every other call."""
        self._queue_turn = not self._queue_turn
        return self._queue_turn

    def next_size(self, budget: int, decode_s: float | None, decoding_rows: int = 1) -> int:
        """The next chunk's tokens, ending before an image's tokens or after them, never inside.

        The shard puts a whole image's rows over its span in one forward: a chunk that would
        end inside one ends before it, or, starting at it, after it (past the budget).
        """
        self.ratio = stall_ratio(decoding_rows)
        size = chunk_tokens(self.item.input_length - self.next_start, budget, decode_s=decode_s,
                            chunk_s_per_token=self.s_per_token, ratio=self.ratio)
        images = self.item.prompt_images
        end = outside_images(self.next_start + size, images)
        if end == self.next_start:  # the chunk starts at an image: it takes the whole image
            image = next(i for i in images if i.token_offset == end)
            end = image.token_offset + image.token_count
        return end - self.next_start

    def is_last(self, size: int) -> bool:
        return self.next_start + size == self.item.input_length

    def due(self, now: float) -> bool:
        """Whether the next chunk may go now beside a decoding batch (see not_before)."""
        return now >= self.not_before

    def go_now(self) -> None:
        """The next chunk is due at once: nothing decodes beside it any more."""
        self.not_before = 0.0

    def advance(self, size: int, elapsed: float, decode_s: float | None,
                now: float | None = None) -> None:
        self.next_start += size
        # what the chunk's tokens added to the step: the riding batch's own step costs decode_s
        added = elapsed - (decode_s or 0.0)
        self.s_per_token = max(added, elapsed / 4) / size
        if decode_s:  # decode alone until the chunk's step and those since average 1 + ratio
            wait = added / self.ratio - decode_s
            self.not_before = (time.monotonic() if now is None else now) + max(0.0, wait)
