"""vLLM's `llama3_json` parser: an answer that is JSON calls, `{"name": ..., "parameters": ...}`.

Llama 3.1-3.3's JSON tool format: the output opens with `{` (or `<|python_tag|>`) and holds calls
separated by `;`; any other output is the answer.
"""
from __future__ import annotations

from router.inputs.tool_parsers.events import ToolDelta
from router.inputs.tool_parsers.json_calls import JsonCalls

PYTHON_TAG = "<|python_tag|>"


class Llama3Json:
    """One choice's output, fed as it streams."""

    reads_special_tokens = False

    def __init__(self):
        self.calls = JsonCalls()
        self.mode: str | None = None  # "calls" or "text", once the output's start says
        self.start = ""

    def feed(self, text: str) -> list[ToolDelta]:
        if self.mode == "calls":
            return self.calls.feed(text)
        if self.mode == "text":
            return [ToolDelta(content=text)] if text else []
        self.start += text
        begun = self.start.lstrip()
        if not begun or (PYTHON_TAG.startswith(begun) and begun != PYTHON_TAG):
            return []  # not yet known
        text, self.start = self.start, ""
        if begun.startswith("{") or begun.startswith(PYTHON_TAG):
            self.mode = "calls"
            return self.calls.feed(begun.removeprefix(PYTHON_TAG))
        self.mode = "text"
        return [ToolDelta(content=text)]

    def finish(self) -> list[ToolDelta]:
        text, self.start = self.start, ""
        return [ToolDelta(content=text)] if text and self.mode is None else []
