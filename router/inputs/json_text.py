"""JSON text parsed with the limits a JSON parser of a public server needs.

Python's parser accepts what JSON does not (`NaN`, `Infinity`), turns `1e400` into infinity, recurses
once per nesting level (5,000 nested arrays raise RecursionError) and refuses integers of more than
4,300 digits with a ValueError. Each of those is the client's mistake and gets a 4xx here.
"""
from __future__ import annotations

import json
import math

from router.errors import BadRequestError

# serde_json's recursion limit, which TGI's parser inherits
MAX_DEPTH = 128

_PARSE = "Failed to parse the request body as JSON: "


class JSONError(ValueError):
    """A text that is not JSON by JSON's own rules, or nested past MAX_DEPTH."""


def _reject_constant(name: str):
    raise JSONError(f"`{name}` is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONError(f"number `{text}` is out of range")
    return value


def loads(text: str):
    """`text` as a JSON value, or a JSONError naming what is wrong with it.

    For a request body, and for JSON a body carries as a string, such as a JSON schema."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError(f"recursion limit exceeded (more than {MAX_DEPTH} nested arrays or "
                        "objects)") from None
    except ValueError as err:  # a JSONDecodeError, or an integer of more than 4,300 digits
        raise JSONError(str(err)) from None
    check_structure(value)
    return value


def parse_json(raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequestError(f"{_PARSE}the body is not valid UTF-8") from None
    try:
        return loads(text)
    except JSONError as err:
        raise BadRequestError(f"{_PARSE}{err}") from None


def check_structure(value) -> None:
    """Checks nesting depth and that every string is valid Unicode.

    Nesting depth at most MAX_DEPTH, and every string encodable as UTF-8 (JSON's `\\ud800`
    escapes decode to lone surrogates, which no tokenizer or protobuf string accepts)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise JSONError(f"recursion limit exceeded (more than {MAX_DEPTH} nested arrays or "
                            "objects)")
        if isinstance(node, dict):
            for key, child in node.items():
                _check_text(key)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in node)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JSONError("a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                        "which is not valid Unicode") from None
