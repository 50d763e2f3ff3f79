"""When a request stops: token budget, end-of-sequence ids, stop sequences."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Numbered as the proto's FinishReason; the router's (router/schemas.py) holds TGI's names."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass(slots=True)
class StopCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    num_generated: int = 0
    # the output's tail, long enough to hold any stop sequence that ends with the latest token
    tail: str = ""
    # when a stop sequence ends inside the latest text: how many of its characters come after it
    excess_chars: int = 0

    def check(self, token_id: int, text: str) -> FinishReason | None:
        """Records one generated token (its id and the text it added) and says whether to stop."""
        self.num_generated += 1
        if self.num_generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        # before min_new_tokens the sampler bans these ids (banned_ids): one that comes anyway
        # is a grammar's only way on, and ends the request
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return FinishReason.EOS_TOKEN
        if self.stop_sequences and text:
            return self._check_stop_sequences(text)
        return None

    def banned_ids(self) -> frozenset[int]:
        """Ids the next token may not be.

        The end-of-sequence ones (stop_token_ids included) while fewer than min_new_tokens were
        generated, as vLLM's and SGLang's min_tokens."""
        return self.eos_token_ids if self.num_generated < self.min_new_tokens else frozenset()

    def _check_stop_sequences(self, text: str) -> FinishReason | None:
        """A stop sequence that ends within `text` stops; the output is cut right after it."""
        self.tail += text
        first_end = None
        for stop in self.stop_sequences:
            # only occurrences that end inside the new text, which earlier checks could not see
            index = self.tail.find(stop, max(len(self.tail) - len(text) - len(stop) + 1, 0))
            if index >= 0 and (first_end is None or index + len(stop) < first_end):
                first_end = index + len(stop)
        if first_end is not None:
            self.excess_chars = len(self.tail) - first_end
            return FinishReason.STOP_SEQUENCE
        keep = max(len(s) for s in self.stop_sequences) + 16
        self.tail = self.tail[-keep:]
        return None
