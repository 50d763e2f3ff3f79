"""One choice's output read for tool calls, in OpenAI's shapes: the message, or a stream's deltas.

A call's first delta carries its index, id, type and name (arguments ""); the next ones its index
and the arguments as they are written, as OpenAI streams them. The whole message is the same
reading of the whole text, so a stream's pieces join into the message.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from router.inputs.tool_parsers import ToolDelta
from router.inputs.tool_parsers.events import merged


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class CallReading:
    """A reader (router.inputs.tool_parsers) over one choice's output, and what it found so far.

    `parallel`: false keeps only the first call (OpenAI's parallel_tool_calls); `new_id`: a
    call's id (ToolPlan.new_call_id)."""

    reader: object
    parallel: bool = True
    new_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"
    content: str = ""
    calls: list[_Call] = field(default_factory=list)

    def feed(self, text: str, *, last: bool = False) -> list[ToolDelta]:
        """The pieces `text` completes; with `last`, what the reader held back too."""
        deltas = self.reader.feed(text) if text else []
        if last:
            deltas += self.reader.finish()
        kept = [d for d in merged(deltas) if self.parallel or d.index in (None, 0)]
        for delta in kept:
            self.content += delta.content
            if delta.name is not None:
                self.calls.append(_Call(self.new_id(), delta.name))
            elif delta.index is not None:
                self.calls[delta.index].arguments += delta.arguments
        return kept

    def finish_reason(self, finish: str) -> str:
        """OpenAI's finish reason: `tool_calls` once calls were read whole.

        Also when max_tokens ended the output just as the last call closed: a grammar's JSON
        ends there (readers that cannot tell whether a call is open say `length`)."""
        if self.calls and (finish == "stop" or not getattr(self.reader, "in_call", True)):
            return "tool_calls"
        return finish

    def stream_delta(self, delta: ToolDelta) -> dict:
        """A piece as a chunk's delta."""
        if delta.index is None:
            return {"role": "assistant", "content": delta.content}
        if delta.name is not None:
            call = self.calls[delta.index]
            piece = {"index": delta.index, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
        else:
            piece = {"index": delta.index, "function": {"arguments": delta.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [piece]}

    def message(self) -> dict:
        """The assistant message of what was read."""
        message = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in self.calls]
        return message
