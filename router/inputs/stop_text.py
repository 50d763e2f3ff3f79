"""Stop sequences: read from a request, and left out of an answer's text, whole or streamed.

TGI's own routes keep the stop sequence in the text; OpenAI's and Ollama's leave it out.
"""
from __future__ import annotations

from router.errors import ValidationError
from router.schemas import FinishReason


def stop_strings(stop, name: str, limit: int) -> list[str]:
    """A request's `stop` (a string or a list of them), at most `limit`, empty ones dropped.

    `name` names the field in a refusal (`stop`, `sampling_params.stop`, ...)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValidationError(f"{name} must be a string or a list of strings")
    if len(stop) > limit:
        raise ValidationError(f"{name} supports up to {limit} stop sequences. Given: {len(stop)}")
    return [s for s in stop if s]


def without_stop(text: str, final, stop_sequences: list[str]) -> str:
    """OpenAI leaves the stop sequence out of the text (TGI's own routes keep it)."""
    if final is not None and final.finish_reason is FinishReason.STOP_SEQUENCE:
        for stop in stop_sequences:
            if text.endswith(stop):
                return text[:-len(stop)]
    return text


class StopHoldback:
    """One streamed choice's text, without its stop sequence.

    The same text as the whole answer's: a stop sequence can span tokens, so the end of the text
    that could begin one waits for the next token (vLLM holds its streams back alike) and is dropped
    if the sequence completes."""

    def __init__(self, stop_sequences: list[str]):
        self.stops = [s for s in stop_sequences if s]
        self.pending = ""

    def text(self, token_text: str, final) -> str:
        """What may go out after this token."""
        text = self.pending + token_text
        if final is not None:
            self.pending = ""
            return without_stop(text, final, self.stops)
        if not self.stops:
            return text
        held = max((_overlap(text, stop) for stop in self.stops), default=0)
        self.pending = text[len(text) - held:]
        return text[:len(text) - held]


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop`.

    Always shorter than `stop`; computed by the prefix function over stop's beginning, a separator
    and text's end, linear in their length (a stop sequence may be thousands of characters)."""
    tail = text[len(text) - min(len(text), len(stop) - 1):]
    if not tail:
        return 0
    sequence = [*stop[:len(tail)], None, *tail]  # None: matches no character
    border = [0] * len(sequence)
    for i in range(1, len(sequence)):
        k = border[i - 1]
        while k and sequence[i] != sequence[k]:
            k = border[k - 1]
        border[i] = k + 1 if sequence[i] == sequence[k] else 0
    return border[-1]
