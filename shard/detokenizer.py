"""Incremental detokenisation: the text each new token adds, never splitting a UTF-8 character.

A request's final text is the concatenation of what it emitted (plus `flush`), so a stream and the
final answer always agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# context kept before the first generated token, enough for merges and leading-space rules
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int
    read_offset: int

    @classmethod
    def start(cls, num_prompt_tokens: int) -> "DetokenizerState":
        return cls(max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens)


def decode_next(decoder: Decoder, ids: list[int], state: DetokenizerState,
                skip_special_tokens: bool) -> str:
    """The text added by ids[state.read_offset:]; advances `state` when it emits.

    A token decoded alone loses context (leading spaces, multi-byte characters spread over
    byte-fallback tokens), so this decodes a short window ending at it and emits what the window
    gained; while the window ends in an incomplete character (U+FFFD), nothing, and the bytes come
    out with a later token."""
    before = decoder.decode(ids[state.prefix_offset:state.read_offset],
                            skip_special_tokens=skip_special_tokens)
    after = decoder.decode(ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    state.prefix_offset = state.read_offset
    state.read_offset = len(ids)
    return after[len(before):]


def flush(decoder: Decoder, ids: list[int], state: DetokenizerState,
          skip_special_tokens: bool) -> str:
    """At the end of a generation: whatever is still held back, even an incomplete character."""
    before = decoder.decode(ids[state.prefix_offset:state.read_offset],
                            skip_special_tokens=skip_special_tokens)
    after = decoder.decode(ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(after) <= len(before):
        return ""
    state.prefix_offset = state.read_offset
    state.read_offset = len(ids)
    return after[len(before):]
