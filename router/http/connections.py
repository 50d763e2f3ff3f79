"""The HTTP listener's guards against connections that hold the process.

Those connections ask nothing. The guards: a ceiling on open connections below the file-descriptor
limit, and a quiet log when the limit is reached anyway or a request cannot be parsed.

Each connection costs a file descriptor. Without a ceiling, enough idle connections ran the router
out of them: every other client was locked out, and asyncio's accept loop logged a traceback per
retry (tens of thousands a second) until the connections went away. Idle and half-sent requests
are closed by aiohttp's keep-alive timeout (KEEPALIVE_TIMEOUT, which also runs from a connection's
start), and a body that does not arrive by the request-body timeout of json_body.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("tgi.router")

# seconds a connection may stay open between requests or while its request's head arrives; nginx's
# default, and well under aiohttp's own (an hour)
KEEPALIVE_TIMEOUT = 75.0

# descriptors kept for everything else: the shards' channels, the gRPC API's connections, files
_RESERVED_FILES = 256


def raise_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit.

    As servers do; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a container may refuse: keep what there is
            pass
    return soft


def connection_ceiling(file_limit: int) -> int:
    """How many HTTP connections may be open at once under a limit of `file_limit` open files."""
    return max(32, file_limit - max(_RESERVED_FILES, file_limit // 10))


_REFUSAL = json.dumps({"error": "Too many open connections: try again later",
                       "error_type": "overloaded"}).encode()
_REFUSAL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                     + str(len(_REFUSAL)).encode() + b"\r\n\r\n" + _REFUSAL)


class _Refusal(asyncio.Protocol):
    """A connection over the ceiling: a 503 in TGI's shape, then closed.

    The close waits a moment (the client's request, unread, would otherwise make the kernel reset
    the connection, and the reset can overtake the answer), unless many refusals are waiting
    already."""

    waiting = 0  # refusals in their moment, each holding a descriptor
    MOST_WAITING = 64
    LINGER = 1.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(_REFUSAL_RESPONSE)
        if _Refusal.waiting >= self.MOST_WAITING or not transport.can_write_eof():
            transport.close()
            self.timer = None
            return
        transport.write_eof()  # the answer, then the end of what we send
        _Refusal.waiting += 1
        self.timer = asyncio.get_running_loop().call_later(self.LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            _Refusal.waiting -= 1


class ConnectionCeiling:
    """The listener's protocol factory, refusing connections past `ceiling`.

    It makes aiohttp's request handlers up to `ceiling` open connections."""

    def __init__(self, server: web.Server, ceiling: int):
        self.server = server
        self.ceiling = ceiling

    def __call__(self) -> asyncio.BaseProtocol:
        # the handlers aiohttp holds; its public `connections` copies them into a list, on every
        # accept, with tens of thousands open
        if len(self.server._connections) >= self.ceiling:
            return _Refusal()
        return self.server()


class QuietAcceptErrors:
    """A loop exception handler that logs failed accepts once a minute.

    Failed accepts: asyncio's "socket.accept() out of system resource", logged as one line and no
    traceback; everything else goes to the default handler (Python 3.11 logs a traceback for every
    retry, which fills the log within seconds)."""

    def __init__(self, every: float = 60.0):
        self.every = every
        self.last = -float("inf")
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < self.every:
            self.suppressed += 1
            return
        log.warning("cannot accept connections: %s (%d more like it since the last warning)",
                    context.get("exception"), self.suppressed)
        self.last, self.suppressed = now, 0


class ClientMistakes(logging.Filter):
    """Logs a request aiohttp could not parse as one warning line.

    Such as a head over 8 KB, a bad chunk size, or both Content-Length and Transfer-Encoding.
    aiohttp's record of one was an ERROR with a traceback, for the client's mistake and not the
    server's."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg = f"{record.msg}: %s"
            record.args = (*(record.args or ()), str(error).strip())
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_client_mistakes() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientMistakes) for f in logger.filters):
        logger.addFilter(ClientMistakes())


async def start_listening(app: web.Application, host: str, port: int, *,
                          keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                          ceiling: int | None = None,
                          shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, asyncio.Server]:
    """Serves `app` on host:port with the guards above.

    The ceiling defaults to what the file limit (raised to its hard limit) allows. Stop with
    listener.close(), then runner.cleanup(), which runs the app's on_shutdown (the router's drain),
    gives the handlers still running `shutdown_timeout` s, and closes the connections."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=keepalive_timeout, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(QuietAcceptErrors())
    quiet_client_mistakes()
    if ceiling is None:
        ceiling = connection_ceiling(raise_file_limit())
    # the listener is ours rather than a TCPSite's, to put the ceiling in its protocol factory
    listener = await loop.create_server(ConnectionCeiling(runner.server, ceiling), host, port,
                                        reuse_address=True)
    log.info("router listening on http://%s:%d (at most %d connections)", host, port, ceiling)
    return runner, listener
