"""JSON answers too large to encode on the event loop: encoded in a worker thread, a piece at a time.

json.dumps of a prompt's hidden states (thousands of rows of floats) is one C call that holds the
interpreter for seconds, wherever it runs: on the event loop it stalled every request (and
/health) that long, and in a thread as one call it would too. Encoded a row at a time in a thread,
the loop gets the interpreter back between rows (every few milliseconds, sys.getswitchinterval).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

# numbers in a value past which it is encoded off the event loop: about 2 ms of json.dumps
LARGE_VALUE_NUMBERS = 4096

STREAM_JSON = {"ensure_ascii": False, "separators": (",", ":")}  # router.http.sse's frames


def dumps_in_pieces(value: Any, **options) -> str:
    """json.dumps(value, **options), the same text, with each list of lists encoded a row at a time.

    `options` may be json.dumps's ensure_ascii and separators.
    """
    item_sep, key_sep = options.get("separators") or (", ", ": ")
    if isinstance(value, dict):
        return "{" + item_sep.join(f"{json.dumps(str(k), **options)}{key_sep}"
                                   f"{dumps_in_pieces(v, **options)}"
                                   for k, v in value.items()) + "}"
    if isinstance(value, list) and any(isinstance(v, (list, dict)) for v in value):
        return "[" + item_sep.join(dumps_in_pieces(v, **options) for v in value) + "]"
    return json.dumps(value, **options)


async def dumps(value: Any, *, numbers: int, **options) -> str:
    """json.dumps(value, **options); off the event loop, in pieces, when it holds many `numbers`.

    `numbers`: the caller's count (or close estimate) of the numbers and strings in `value`.
    """
    if numbers <= LARGE_VALUE_NUMBERS:
        return json.dumps(value, **options)
    return await asyncio.to_thread(dumps_in_pieces, value, **options)
