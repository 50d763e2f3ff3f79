"""Tool calls written as JSON objects, scanned as they stream: `{"name": ..., "arguments": ...}`.

The objects may stand alone, follow one another (separated by `,` or `;`) or sit in an array; a
call's arguments may be named `arguments` (OpenAI's, Hermes') or `parameters` (Llama 3's). The name
goes out once its string is whole, the arguments as their JSON text is written. The call named
`no_tool` (TGI's answer in words under tool_choice=auto) is no call: its `content` string is the
answer, decoded as it streams.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from router.inputs.tool_parsers.events import ToolDelta

_ARGUMENT_KEYS = ("arguments", "parameters")
_PLAIN = re.compile(r'[^"\\]+')  # a run of a JSON string's characters that are themselves
_SPECIAL = re.compile(r'["\\]')
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_BARE = re.compile(r'[^"{}\[\]]+')  # inside an object or array, outside its strings
_SPACE = " \t\r\n"
# the five states of a call object, after its `{`
_KEY, _IN_KEY, _COLON, _WAIT, _VALUE = range(5)


@dataclass(slots=True)
class _Value:
    """Where one JSON value is in its text: its depth, and whether a string is open."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False
    done: bool = False

    def take(self, c: str) -> bool:
        """Whether `c` belongs to the value (a number, true... ends at the character after it)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if self.scalar:
            if c in ",}];" or c in _SPACE:
                self.done = True
                return False
            return True
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth <= 0
        elif self.depth == 0:
            self.scalar = True
        return True


def _high_surrogate(digits: str) -> bool:
    try:
        return 0xD800 <= int(digits, 16) < 0xDC00
    except ValueError:  # not hex: the escape is no JSON, and _decoded drops it
        return False


def _decoded(escape: str) -> str:
    """An escape's text; a lone surrogate half is U+FFFD, as UTF-8 (the answer's bytes) has none."""
    try:
        return _LONE_SURROGATE.sub("\ufffd", json.loads(f'"{escape}"'))
    except ValueError:
        return ""


@dataclass(slots=True)
class _Text:
    """The text of `{"content": "..."}` as it is written: each escape decoded once it is whole."""

    after_colon: bool = False
    started: bool = False
    ended: bool = False
    escape: str = ""

    def take_text(self, text: str) -> str:
        if self.started and not self.ended and not self.escape and not _SPECIAL.search(text):
            return text
        return "".join(self.take(c) for c in text)

    def take(self, c: str) -> str:
        if self.ended:
            return ""
        if not self.started:
            self.after_colon = self.after_colon or c == ":"
            self.started = self.after_colon and c == '"'
            return ""
        if self.escape:
            self.escape += c
            text = self.escape
            whole = 6 if text[1] == "u" else 2
            if len(text) >= 6 and whole == 6 and _high_surrogate(text[2:6]):
                if not "\\u".startswith(text[6:8]):  # a lone half: what follows is read anew
                    self.escape = ""
                    return _decoded(text[:6]) + "".join(self.take(x) for x in text[6:])
                whole = 12  # a surrogate pair: its second half follows
            if len(text) < whole:
                return ""
            self.escape = ""
            return _decoded(text)
        if c == "\\":
            self.escape = c
        elif c == '"':
            self.ended = True
        else:
            return c
        return ""


@dataclass(slots=True)
class _Call:
    state: int = _KEY
    value: _Value = field(default_factory=_Value)  # the key's or the value's
    key: str = ""
    name_text: str = ""
    name: str | None = None
    pending_arguments: str = ""  # written before the name was known
    has_arguments: bool = False
    index: int | None = None  # given when the name is known
    answer: _Text | None = None  # a no_tool call's content


class JsonCalls:
    """Scans JSON tool calls as they stream; text outside the objects is passed over."""

    def __init__(self, *, no_tool: str | None = None):
        self.no_tool = no_tool
        self.next_index = 0
        self.call: _Call | None = None
        self.open_lists = 0  # `[` around the calls

    @property
    def in_call(self) -> bool:
        """Whether a call, or a list of them, is open: the calls read so far may not be all."""
        return self.call is not None or self.open_lists > 0

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        at = 0
        while at < len(text):
            call = self.call
            if call is not None and call.state == _VALUE and not call.value.escaped:
                # a run that changes nothing of the value's state, in one step: a long answer is
                # not scanned a character at a time (a quote, backslash or bracket ends the run)
                value = call.value
                nested = value.depth > 0 and not value.scalar
                pattern = _PLAIN if value.in_string else _BARE if nested else None
                plain = pattern.match(text, at) if pattern is not None else None
                if plain is not None:
                    self._value_text(call, plain.group(), out)
                    at = plain.end()
                    continue
            self._char(text[at], out)
            at += 1
        return out

    def finish(self) -> list[ToolDelta]:
        """Nothing more: a call cut short has sent what it had."""
        self.drop_call()
        return []

    def drop_call(self) -> None:
        """Ends the open call where it is (its format's closing tag came)."""
        self.call = None

    def new_index(self) -> int:
        """The index of a call read elsewhere (Mistral's `name[ARGS]`), counted with these."""
        self.next_index += 1
        return self.next_index - 1

    def _char(self, c: str, out: list[ToolDelta]) -> None:
        call = self.call
        if call is None:
            if c == "{":
                self.call = _Call()
            elif c in "[]":
                self.open_lists += 1 if c == "[" else -1
            return
        if call.state == _VALUE:
            if call.value.take(c):
                self._value_text(call, c, out)
                if call.value.done:
                    self._value_end(call, out)
                return
            self._value_end(call, out)  # a number (or true...) ended: `c` is the object's
        if call.state == _KEY:
            if c == '"':
                call.state, call.value, call.key = _IN_KEY, _Value(), ""
                call.value.take(c)
            elif c == "}":
                self._end(call, out)
        elif call.state == _IN_KEY:
            call.value.take(c)
            if call.value.done:
                call.state = _COLON
            else:
                call.key += c
        elif call.state == _COLON:
            if c == ":":
                call.state = _WAIT
        elif call.state == _WAIT and c not in _SPACE:
            call.state, call.value = _VALUE, _Value()
            self._char(c, out)

    def _value_text(self, call: _Call, text: str, out: list[ToolDelta]) -> None:
        if call.key == "name":
            call.name_text += text
        elif call.key in _ARGUMENT_KEYS:
            call.has_arguments = True
            if call.name is None:
                call.pending_arguments += text
            else:
                self._arguments(call, text, out)

    def _arguments(self, call: _Call, text: str, out: list[ToolDelta]) -> None:
        if call.answer is not None:
            content = call.answer.take_text(text)
            if content:
                out.append(ToolDelta(content=content))
        elif text:
            out.append(ToolDelta(index=call.index, arguments=text))

    def _value_end(self, call: _Call, out: list[ToolDelta]) -> None:
        if call.key == "name" and call.name is None:
            try:
                name = json.loads(call.name_text)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self._named(call, name, out)
        call.state = _KEY

    def _named(self, call: _Call, name: str, out: list[ToolDelta]) -> None:
        call.name = name
        if name == self.no_tool:
            call.answer = _Text()
        else:
            call.index = self.new_index()
            out.append(ToolDelta(index=call.index, name=name))
        pending, call.pending_arguments = call.pending_arguments, ""
        self._arguments(call, pending, out)

    def _end(self, call: _Call, out: list[ToolDelta]) -> None:
        if call.index is not None and not call.has_arguments:
            out.append(ToolDelta(index=call.index, arguments="{}"))
        self.call = None


class JsonValue:
    """One JSON value's text as it streams: how much of each piece belongs to it."""

    def __init__(self):
        self.value = _Value()
        self.started = False

    @property
    def done(self) -> bool:
        return self.value.done

    def feed(self, text: str) -> tuple[int, str]:
        """(how much of `text` is the value's, white space before it included; the value's part)."""
        start = None
        for i, c in enumerate(text):
            if self.value.done:
                return i, text[start:i] if start is not None else ""
            if not self.started:
                if c in _SPACE:
                    continue
                self.started = True
            if start is None:
                start = i
            if not self.value.take(c):
                return i, text[start:i]
        return len(text), text[start:] if start is not None else ""
