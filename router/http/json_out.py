"""JSON answers too large to encode on the event loop: encoded in a worker thread, a piece at a time.

json.dumps of a prompt's hidden states (thousands of rows of floats) is one C call that holds the
interpreter for seconds, wherever it runs: on the event loop it stalled every request (and
/health) that long, and in a thread as one call it would too. Encoded a row at a time in a thread,
the loop gets the interpreter back between rows (every few milliseconds, sys.getswitchinterval).
Float32 arrays (hidden states) are written by orjson, each value in the fewest digits that read
back as the same float32: 1,500 rows of 576 take 30 ms and 9 MB, where json.dumps of their
Python floats took 500 ms and 17 MB of the CPU the shards share.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy
import orjson

# numbers in a value past which it is encoded off the event loop: about 2 ms of json.dumps
LARGE_VALUE_NUMBERS = 4096

STREAM_JSON = {"ensure_ascii": False, "separators": (",", ":")}  # router.http.sse's frames


def dumps_in_pieces(value: Any, **options) -> str:
    """json.dumps(value, **options), the same text, with each list of lists encoded a row at a time.

    `options` may be json.dumps's ensure_ascii and separators.
    """
    item_sep, key_sep = options.get("separators") or (", ", ": ")
    if isinstance(value, numpy.ndarray):
        return _array_json(value, item_sep)
    if isinstance(value, dict):
        return "{" + item_sep.join(f"{json.dumps(str(k), **options)}{key_sep}"
                                   f"{dumps_in_pieces(v, **options)}"
                                   for k, v in value.items()) + "}"
    if isinstance(value, list) and any(isinstance(v, (list, dict, numpy.ndarray)) for v in value):
        return "[" + item_sep.join(dumps_in_pieces(v, **options) for v in value) + "]"
    return json.dumps(value, **options)


def _array_json(array: numpy.ndarray, item_sep: str) -> str:
    """A float array as JSON: nested lists, a slice of rows at a time."""
    if array.ndim < 2 or array.size <= ARRAY_PIECE_NUMBERS:
        return orjson.dumps(numpy.ascontiguousarray(array),
                            option=orjson.OPT_SERIALIZE_NUMPY).decode()
    step = max(1, ARRAY_PIECE_NUMBERS // (array.size // len(array)))
    return "[" + item_sep.join(_array_json(array[i:i + step], item_sep)[1:-1]
                               for i in range(0, len(array), step)) + "]"


# numbers orjson writes in one call (about 5 ms), so that the event loop gets the interpreter back
ARRAY_PIECE_NUMBERS = 1 << 17


async def dumps(value: Any, *, numbers: int, **options) -> str:
    """json.dumps(value, **options); off the event loop, in pieces, when it holds many `numbers`.

    `numbers`: the caller's count (or close estimate) of the numbers and strings in `value`.
    numpy arrays in it are written as nested lists.
    """
    if numbers <= LARGE_VALUE_NUMBERS:
        try:  # every streamed frame: json.dumps in one call, unless an array is in it
            return json.dumps(value, **options)
        except TypeError:
            return dumps_in_pieces(value, **options)
    return await asyncio.to_thread(dumps_in_pieces, value, **options)
