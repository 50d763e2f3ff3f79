"""vLLM's `mistral` parser: calls after `[TOOL_CALLS]`, as a JSON array or as `name[ARGS]{...}`.

Mistral's formats: `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` (tokenizers before v11)
and `[TOOL_CALLS]name[ARGS]{...}` per call (v11 on). Text before the first is the answer. The
router must keep the tag in the text: Mistral tokenizers mark it special.
"""
from __future__ import annotations

import secrets
import string

from router.inputs.tool_parsers.events import ToolDelta, held_tag
from router.inputs.tool_parsers.json_calls import JsonCalls, JsonValue

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARACTERS = string.ascii_letters + string.digits


class Mistral:
    """One choice's output, fed as it streams."""

    reads_special_tokens = True

    @staticmethod
    def call_id() -> str:
        """A call's id as Mistral's templates take it back: nine letters and digits.

        Their tool turns refuse any other (vLLM's mistral parser makes the same)."""
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    def __init__(self):
        self.calls = JsonCalls()
        self.state = "text"  # then "start" (after a tag), "array", "name", "arguments"
        self.pending = ""
        self.name = ""
        self.index = 0
        self.arguments: JsonValue | None = None

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        text, self.pending = self.pending + text, ""
        while text:
            text = getattr(self, f"_{self.state}")(text, out)
        return out

    def finish(self) -> list[ToolDelta]:
        text, self.pending = self.pending, ""
        return [ToolDelta(content=text)] if text and self.state == "text" else []

    def _hold(self, text: str, tag: str) -> tuple[str, str]:
        """(what is surely not `tag`, the end of `text` that may begin it)."""
        held = held_tag(text, (tag,))
        return text[:len(text) - held], text[len(text) - held:]

    def _text(self, text: str, out: list[ToolDelta]) -> str:
        at = text.find(TOOL_CALLS)
        said, self.pending = self._hold(text, TOOL_CALLS) if at < 0 else (text[:at], "")
        if said:
            out.append(ToolDelta(content=said))
        if at < 0:
            return ""
        self.state = "start"
        return text[at + len(TOOL_CALLS):]

    def _start(self, text: str, out: list[ToolDelta]) -> str:
        begun = text.lstrip()
        if begun:
            self.state = "array" if begun[0] in "[{" else "name"
            self.name = ""
        return begun

    def _array(self, text: str, out: list[ToolDelta]) -> str:
        out.extend(self.calls.feed(text))
        return ""

    def _name(self, text: str, out: list[ToolDelta]) -> str:
        at = text.find(ARGS)
        if at < 0:
            named, self.pending = self._hold(text, ARGS)
            self.name += named
            return ""
        self.name += text[:at]
        self.index = self.calls.new_index()
        out.append(ToolDelta(index=self.index, name=self.name.strip()))
        self.state, self.arguments = "arguments", JsonValue()
        return text[at + len(ARGS):]

    def _arguments(self, text: str, out: list[ToolDelta]) -> str:
        used, arguments = self.arguments.feed(text)
        if arguments:
            out.append(ToolDelta(index=self.index, arguments=arguments))
        if not self.arguments.done:
            return ""
        self.state = "text"  # the next call has its own tag; white space between is no answer
        return text[used:].lstrip()
