"""Server-Sent Events: the framing, and the one driver every streaming route runs.

An API module says how its stream looks (a StreamFormat); the driver does the rest the same way
for all of them: an error before the first event answers with its HTTP status, an error after it
is the format's last data frame, a client that goes away closes the core's stream (which cancels
the requests and frees their blocks), and a stream that ends without its final event is an error.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from router.errors import GenerationError, IncompleteGenerationError, RouterError
from router.schemas import TokenEvent
from router.telemetry.request_record import current_record

log = logging.getLogger("tgi.router.streaming")


def sse_data(payload: dict | str, *, openai: bool = False) -> bytes:
    """One event.

    TGI's routes write `data:{...}`; OpenAI's write `data: {...}` and end with `data: [DONE]`, which
    some clients compare byte for byte."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n".encode() if openai else f"data:{data}\n\n".encode()


def openai_sse(payload: dict | str) -> bytes:
    return sse_data(payload, openai=True)


class StreamFormat:
    """How one API writes a stream; each method returns the frames to write, in order."""

    def opening(self) -> list[bytes]:
        """Right after the headers, before the first event."""
        return []

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        """One event of the request at `index` (several requests share a stream with n > 1)."""
        raise NotImplementedError

    def closing(self) -> list[bytes]:
        """After every request's final event."""
        return []

    def error(self, err: RouterError) -> bytes | None:
        """The frame that reports `err`; None for a format that cannot say it.

        Plain text cannot: the connection is then cut, so the client sees a broken stream, never a
        short clean one."""
        raise NotImplementedError

    def done(self) -> list[bytes]:
        """Last of all, after a success or an error."""
        return []


async def serve_stream(request: web.Request, events: AsyncIterator[tuple[int, TokenEvent]],
                       form: StreamFormat, *, streams: int = 1,
                       headers: dict | None = None,
                       content_type: str = "text/event-stream") -> web.StreamResponse:
    """Writes `events` (from Infer.stream_many over `streams` requests) as `form` says."""
    try:
        # validation and admission errors answer with their status before the stream opens
        item = await anext(events, None)
        response = web.StreamResponse(headers={
            "Content-Type": content_type, "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **(headers or {})})
        await response.prepare(request)
        try:
            await _write(response, form.opening())
            finished = 0
            while item is not None:
                index, event = item
                await _write(response, form.event(index, event))
                finished += event.final is not None
                item = await anext(events, None)
            if finished < streams:
                raise IncompleteGenerationError("Incomplete generation stream")
            await _write(response, form.closing())
        except RouterError as err:
            _note_error(err)
            if not await _report(request, response, form.error(err)):
                return response
        except ConnectionResetError:  # the client went away: nobody to tell, nothing to log
            return response  # (events.aclose below frees what its requests held)
        except Exception as err:  # a bug: the client still hears of it in the stream's own shape
            log.exception("stream failed after it opened")
            failure = GenerationError(f"{type(err).__name__}: {err}")
            _note_error(failure)
            frame = form.error(failure)
            if not await _report(request, response, frame):
                return response
        await _write(response, form.done())
        await response.write_eof()
        return response
    finally:
        await events.aclose()


async def _report(request: web.Request, response: web.StreamResponse,
                  frame: bytes | None) -> bool:
    """Writes an error frame; without one, cuts the connection. Whether the stream goes on."""
    if frame is not None:
        await response.write(frame)
        return True
    response.force_close()
    if request.transport is not None:
        request.transport.close()
    return False


async def _write(response: web.StreamResponse, frames: list[bytes]) -> None:
    for frame in frames:
        await response.write(frame)


def _note_error(err: RouterError) -> None:
    """The access log's line says why a stream that answered 200 failed."""
    record = current_record()
    if record is not None:
        record.error_type = err.error_type
