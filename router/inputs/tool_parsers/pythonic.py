"""vLLM's `pythonic` parser: an answer that is a Python list of calls, `[f(a=1), g(b="x")]`.

Llama 3.2 / 4's and ToolACE's format. Each call goes out whole once its parenthesis closes (its
arguments are Python literals, made JSON); an output that does not open such a list is the answer.
"""
from __future__ import annotations

import ast
import json
import re

from router.inputs.tool_parsers.events import ToolDelta

_OPENS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_NAME_CHARS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*")


def _could_open(begun: str) -> bool:
    """Whether `begun` may still become the opening of a call list."""
    return begun in ("", "[") or bool(_NAME_CHARS.fullmatch(begun))


def _call(source: str) -> tuple[str, str] | None:
    """A call's (name, arguments as JSON), or None if it is not a call of literals."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return None
    except (RecursionError, MemoryError):  # Python's parser on a deep nesting (`----1`)
        return None


class Pythonic:
    """One choice's output, fed as it streams."""

    reads_special_tokens = False

    def __init__(self):
        self.mode: str | None = None  # "calls" or "text", once the output's start says
        self.text = ""  # the output so far, in calls mode from its `[` on
        self.depth = 0  # brackets open, the list's own included
        self.quote = ""  # the open string's quote
        self.escaped = False
        self.call_start = 1
        self.index = 0

    def feed(self, text: str) -> list[ToolDelta]:
        if self.mode == "text":
            return [ToolDelta(content=text)] if text else []
        if self.mode is None:
            self.text += text
            begun = self.text.lstrip()
            if _could_open(begun):
                return []
            if not _OPENS.match(begun):
                self.mode = "text"
                return [ToolDelta(content=self.text)]
            self.mode, self.text, text = "calls", "", begun
        out: list[ToolDelta] = []
        for c in text:
            self._char(c, out)
        return out

    def finish(self) -> list[ToolDelta]:
        if self.mode is None and self.text:
            return [ToolDelta(content=self.text)]
        return []

    def _char(self, c: str, out: list[ToolDelta]) -> None:
        self.text += c
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == self.quote:
                self.quote = ""
            return
        if c in "'\"":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}":
            self.depth -= 1
            if c == ")" and self.depth == 1:
                self._close(out)
        elif c == "," and self.depth == 1:
            self.call_start = len(self.text)

    def _close(self, out: list[ToolDelta]) -> None:
        call = _call(self.text[self.call_start:])
        if call is None:
            return
        out.append(ToolDelta(index=self.index, name=call[0]))
        out.append(ToolDelta(index=self.index, arguments=call[1]))
        self.index += 1
