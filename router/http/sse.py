"""Server-Sent Events: the framing, and the one driver every streaming route runs.

An API module says how its stream looks (a StreamFormat); the driver does the rest the same way
for all of them: an error before the first event answers with its HTTP status, an error after it
is the format's last data frame, a client that goes away, or that takes no frame within
--stream-write-timeout, closes the core's stream (which cancels the requests and frees their
blocks), and a stream that ends without its final event is an error.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from router.errors import (GenerationError, IncompleteGenerationError, RouterError,
                           SlowReaderError)
from router.schemas import TokenEvent
from router.telemetry.request_record import current_record

log = logging.getLogger("tgi.router.streaming")

# seconds a frame may wait for its client to take it (--stream-write-timeout; router/app.py)
WRITE_TIMEOUT = web.AppKey("stream_write_timeout", float)


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

    def bind(self, request: web.Request) -> None:
        """Sees the request the stream answers, before the first frame.

        For a format whose frames depend on the client (router.api.openai.common.OpenAIStream)."""

    def opening(self) -> list[bytes]:
        """Right after the headers, before the first event."""
        return []

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        """One event of the request at `index` (several requests share a stream with n > 1)."""
        raise NotImplementedError

    async def event_frames(self, index: int, event: TokenEvent) -> list[bytes]:
        """event()'s frames; a format whose frames can be large encodes them off the event loop."""
        return self.event(index, event)

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
    """Writes `events` (from Infer.stream_many over `streams` requests) as `form` says.

    A frame the client has not taken after the app's --stream-write-timeout (WRITE_TIMEOUT) ends
    the stream: nothing more can reach a client that reads nothing, so the connection is cut,
    and closing `events` cancels what its requests still generate.
    """
    form.bind(request)
    try:
        # validation and admission errors answer with their status before the stream opens
        item = await anext(events, None)
        response = web.StreamResponse(headers={
            "Content-Type": content_type, "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **(headers or {})})
        await response.prepare(request)
        write = _Writer(response, request.app[WRITE_TIMEOUT])
        try:
            await _serve(request, response, write, events, item, form, streams)
        except ConnectionResetError:  # the client went away: nobody to tell, nothing to log
            pass  # (events.aclose below frees what its requests held)
        except _NotTaken as stopped:
            log.info("stream cut: %s", stopped.error)
            _note_error(stopped.error)
            response.force_close()
            if request.transport is not None:
                request.transport.abort()  # close() would wait for the client to take the rest
        return response
    finally:
        await events.aclose()


async def _serve(request: web.Request, response: web.StreamResponse, write: _Writer,
                 events: AsyncIterator[tuple[int, TokenEvent]], item, form: StreamFormat,
                 streams: int) -> None:
    """The stream from its first event (`item`) on; _NotTaken when the client stopped reading."""
    try:
        await write(form.opening())
        finished = 0
        while item is not None:
            index, event = item
            await write(await form.event_frames(index, event))
            finished += event.final is not None
            item = await anext(events, None)
        if finished < streams:
            raise IncompleteGenerationError("Incomplete generation stream")
        await write(form.closing())
    except RouterError as err:
        _note_error(err)
        if not await _report(request, response, write, form.error(err)):
            return
    except (ConnectionResetError, _NotTaken):
        # reset: the client went away, with nobody to tell and nothing to log (serve_stream
        # closes the events, which frees what its requests held)
        raise
    except Exception as err:  # a bug: the client still hears of it in the stream's own shape
        log.exception("stream failed after it opened")
        failure = GenerationError(f"{type(err).__name__}: {err}")
        _note_error(failure)
        if not await _report(request, response, write, form.error(failure)):
            return
    await write(form.done())
    await write.eof()


class _NotTaken(Exception):
    """A frame the client did not take within the write timeout."""

    def __init__(self, error: SlowReaderError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class _Writer:
    """Writes a stream's frames, each taken by the client within `timeout` seconds or _NotTaken."""

    response: web.StreamResponse
    timeout: float

    async def __call__(self, frames: list[bytes]) -> None:
        for frame in frames:
            await self._within(self.response.write(frame))

    async def eof(self) -> None:
        await self._within(self.response.write_eof())

    async def _within(self, write) -> None:
        # aiohttp's write returns at once while its buffer has room: it waits only on a client
        # whose socket takes nothing more
        try:
            async with asyncio.timeout(self.timeout):
                await write
        except TimeoutError:
            raise _NotTaken(SlowReaderError(
                f"the client took nothing for {self.timeout:g} s (--stream-write-timeout)")
            ) from None


async def _report(request: web.Request, response: web.StreamResponse, write: _Writer,
                  frame: bytes | None) -> bool:
    """Writes an error frame; without one, cuts the connection. Whether the stream goes on."""
    if frame is not None:
        await write([frame])
        return True
    response.force_close()
    if request.transport is not None:
        request.transport.close()
    return False


def _note_error(err: RouterError) -> None:
    """The access log's line says why a stream that answered 200 failed."""
    record = current_record()
    if record is not None:
        record.error_type = err.error_type
