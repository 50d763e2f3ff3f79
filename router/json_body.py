"""Request bodies as JSON, with the limits a JSON parser of a public server needs.

Python's parser accepts what JSON does not (`NaN`, `Infinity`), turns `1e400` into infinity, recurses
once per nesting level (5,000 nested arrays raise RecursionError) and refuses integers of more than
4,300 digits with a ValueError. Each of those is the client's mistake and gets a 422 here.
"""
from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web

from router.errors import BadRequestError, PayloadTooLargeError, RequestTimeoutError

# serde_json's recursion limit, which TGI's parser inherits
MAX_DEPTH = 128

_PARSE = "Failed to parse the request body as JSON: "
# how long a request's body may take to arrive once its head has (a slow body holds a connection
# and a handler): BODY_TIMEOUT seconds, and a second more per SLOWEST_BODY_RATE bytes it may hold
BODY_TIMEOUT = 60.0
SLOWEST_BODY_RATE = 64 * 1024
_INLINE_BYTES = 32_768  # smaller bodies parse faster than a thread hop


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
    """`text` as a JSON value, or a JSONError naming what is wrong with it (for a request body,
    and for JSON a body carries as a string, such as a JSON schema)."""
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
    """Nesting depth at most MAX_DEPTH, and every string encodable as UTF-8 (JSON's `\\ud800`
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


async def read_object(request) -> dict:
    """An HTTP request's body, which must be a JSON object (an aiohttp request)."""
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        # refused before reading: the client need not send a body that will not be read, and the
        # connection closes, as the rest of the body would come next on it
        error = PayloadTooLargeError(f"Maximum request body size {limit} exceeded.")
        error.close_connection = True
        raise error
    size = request.content_length if request.content_length is not None else limit
    allowed = BODY_TIMEOUT + size / SLOWEST_BODY_RATE  # 60 s, and 31 s more for 2 MB
    try:
        async with asyncio.timeout(allowed):
            raw = await request.read()
    except web.HTTPException:  # the payload limit's 413, shaped by the error middleware
        raise
    except TimeoutError:
        request.content.feed_eof()  # as below: what was not read stays unread
        error = RequestTimeoutError(f"the request body did not arrive within {allowed:.0f} s")
        error.close_connection = True
        raise error from None
    except Exception as err:  # a body its Content-Encoding does not decode (RequestPayloadError)
        # the rest of the body stays unreadable: the connection closes after the answer, and
        # aiohttp, told the body ended, does not read on into the same error (which it logged
        # as a traceback per request)
        request.content.feed_eof()
        error = BadRequestError(f"Failed to read the request body: {err}")
        error.close_connection = True
        raise error from None
    # checking a body of megabytes walks every value in Python (0.5 s for a million numbers):
    # off the event loop, which serves every other request meanwhile
    body = parse_json(raw) if len(raw) < _INLINE_BYTES else await asyncio.to_thread(parse_json, raw)
    if not isinstance(body, dict):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: expected "
                              "an object")
    return body
