"""What a tool parser reports as a model's output streams in: answer text and tool-call pieces."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ToolDelta:
    """A piece of one choice's output.

    Answer text (`content`), or a piece of call `index`: its `name` on the call's first piece, then
    `arguments` text (JSON) as it is written."""

    content: str = ""
    index: int | None = None
    name: str | None = None
    arguments: str = ""


def merged(deltas: list[ToolDelta]) -> list[ToolDelta]:
    """`deltas` with neighbours that can be one joined: a delta per token, not per character."""
    out: list[ToolDelta] = []
    for delta in deltas:
        if not delta.content and delta.index is None:
            continue
        last = out[-1] if out else None
        # a call's name goes alone, as OpenAI's first delta of a call (its arguments "")
        if last is not None and delta.name is None and last.index == delta.index and (
                last.index is None or last.name is None):
            out[-1] = ToolDelta(last.content + delta.content, last.index, last.name,
                                last.arguments + delta.arguments)
        else:
            out.append(delta)
    return out


def held_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (and is not all of it)."""
    for length in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-length:]) for tag in tags):
            return length
    return 0
