"""An HTTP request's body read as a JSON object.

Size and time limits, then the parse of router.inputs.json_text (off the event loop for a large
body).
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from router.errors import BadRequestError, PayloadTooLargeError, RequestTimeoutError
from router.inputs.json_text import parse_json

# how long a request's body may take to arrive once its head has (a slow body holds a connection
# and a handler): BODY_TIMEOUT seconds, and a second more per SLOWEST_BODY_RATE bytes it may hold
BODY_TIMEOUT = 60.0
SLOWEST_BODY_RATE = 64 * 1024
_INLINE_BYTES = 32_768  # smaller bodies parse faster than a thread hop


async def read_object(request) -> dict:
    """An HTTP request's body, which must be a JSON object (an aiohttp request)."""
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        # refused before reading: the client need not send a body that will not be read, and the
        # connection closes, as the rest of the body would come next on it
        raise PayloadTooLargeError(f"Maximum request body size {limit} exceeded.",
                                   close_connection=True)
    size = request.content_length if request.content_length is not None else limit
    allowed = BODY_TIMEOUT + size / SLOWEST_BODY_RATE  # 60 s, and 31 s more for 2 MB
    try:
        async with asyncio.timeout(allowed):
            raw = await request.read()
    except web.HTTPException:  # the payload limit's 413, shaped by the error middleware
        raise
    except TimeoutError:
        request.content.feed_eof()  # as below: what was not read stays unread
        raise RequestTimeoutError(f"the request body did not arrive within {allowed:.0f} s",
                                  close_connection=True) from None
    except Exception as err:  # a body its Content-Encoding does not decode (RequestPayloadError)
        # the rest of the body stays unreadable: the connection closes after the answer, and
        # aiohttp, told the body ended, does not read on into the same error (which it logged
        # as a traceback per request)
        request.content.feed_eof()
        raise BadRequestError(f"Failed to read the request body: {err}",
                              close_connection=True) from None
    # checking a body of megabytes walks every value in Python: off the event loop, which serves
    # every other request meanwhile
    body = parse_json(raw) if len(raw) < _INLINE_BYTES else await asyncio.to_thread(parse_json, raw)
    if not isinstance(body, dict):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: expected "
                              "an object")
    return body
