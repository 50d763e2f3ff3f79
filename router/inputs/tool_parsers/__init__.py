"""--tool-call-parser: tool calls read from a model's own format, as vLLM's parsers read them.

Each parser takes one choice's output as it streams (`feed`, then `finish`) and answers ToolDeltas:
the answer's text and each call's name, then its arguments.
"""
from __future__ import annotations

from router.inputs.tool_parsers.events import ToolDelta
from router.inputs.tool_parsers.hermes import Hermes
from router.inputs.tool_parsers.json_calls import JsonCalls
from router.inputs.tool_parsers.llama3_json import Llama3Json
from router.inputs.tool_parsers.mistral import Mistral
from router.inputs.tool_parsers.pythonic import Pythonic

PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral,
           "pythonic": Pythonic}

__all__ = ["PARSERS", "JsonCalls", "ToolDelta", "check_tool_parser"]


def check_tool_parser(name: str | None, enable_auto_tool_choice: bool) -> None:
    """Refuses, at start, a parser this router does not have, and auto without a parser."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(PARSERS)}")
    if enable_auto_tool_choice and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the parser reads "
                         "the calls a model writes in its own format")
