"""When a request stops: token budget, end-of-sequence ids, stop sequences."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
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

    def check(self, token_id: int, text: str) -> FinishReason | None:
        """Records one generated token (its id and the text it added) and says whether to stop."""
        self.num_generated += 1
        if self.num_generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        if (token_id in self.eos_token_ids and not self.ignore_eos
                and self.num_generated >= self.min_new_tokens):
            return FinishReason.EOS_TOKEN
        if self.stop_sequences and text:
            self.tail += text
            if any(self.tail.endswith(stop) or stop in self.tail[-(len(stop) + len(text)):]
                   for stop in self.stop_sequences):
                return FinishReason.STOP_SEQUENCE
            keep = max(len(s) for s in self.stop_sequences) + 16
            self.tail = self.tail[-keep:]
        return None
