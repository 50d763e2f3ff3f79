"""vLLM's `hermes` parser: calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

The format of Hermes 2 Pro, Qwen 2.5 and Qwen 3; text around the blocks is the answer, less the
white space just before a call (and at the end, after one).
"""
from __future__ import annotations

from router.inputs.tool_parsers.events import ToolDelta, held_tag
from router.inputs.tool_parsers.json_calls import JsonCalls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes:
    """One choice's output, fed as it streams."""

    reads_special_tokens = False

    def __init__(self):
        self.calls = JsonCalls()
        self.inside = False
        self.pending = ""  # what may begin a tag
        self.spaces = ""  # white space that goes out only if more answer follows it

    @property
    def in_call(self) -> bool:
        return self.inside

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        text, self.pending = self.pending + text, ""
        while text:
            tag = CLOSE if self.inside else OPEN
            at = text.find(tag)
            if at < 0:
                held = held_tag(text, (tag,))
                text, self.pending = text[:len(text) - held], text[len(text) - held:]
                self._take(text, out)
                return out
            self._take(text[:at], out)
            if self.inside:
                self.calls.drop_call()  # a block ends its call, whole or not
            else:
                self.spaces = ""
            self.inside = not self.inside
            text = text[at + len(tag):]
        return out

    def finish(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if not self.inside:
            self._take(self.pending, out)
            if self.calls.next_index == 0 and self.spaces:
                out.append(ToolDelta(content=self.spaces))
        self.pending = self.spaces = ""
        return out

    def _take(self, text: str, out: list[ToolDelta]) -> None:
        if self.inside:
            out.extend(self.calls.feed(text))
            return
        text = self.spaces + text
        said = text.rstrip()
        self.spaces = text[len(said):]
        if said:
            out.append(ToolDelta(content=said))
