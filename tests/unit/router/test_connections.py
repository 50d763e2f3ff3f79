"""The HTTP listener's guards: a ceiling on open connections, idle and half-sent requests closed,
a body that does not come or could not fit refused, and a quiet log when accepts fail."""
import asyncio
import json
import logging
import time

import pytest
from aiohttp import web

from router.http import connections, json_body
from router.http.json_body import read_object
from router.api.tgi.errors import tgi_error_body
from router.http.middleware import ErrorBodies, error_middleware
from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.waiting import wait_until_async


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await read_object(request))


async def _serve(**options):
    app = web.Application(client_max_size=1000, middlewares=[error_middleware(ErrorBodies(tgi_error_body))])
    app.router.add_post("/echo", _echo)
    runner, listener = await connections.start_listening(app, "127.0.0.1", 0, **options)
    return runner, listener, listener.sockets[0].getsockname()[1]


async def _stop(runner, listener):
    listener.close()
    await runner.cleanup()


async def _answer(reader, timeout=5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)  # to the connection's end


async def _response(reader, timeout=5.0) -> tuple[bytes, dict]:
    """One response's head and its JSON body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    return head, json.loads(await asyncio.wait_for(reader.readexactly(length), timeout))


async def test_connections_past_the_ceiling_get_a_503_and_the_rest_are_served():
    runner, listener, port = await _serve(ceiling=3)
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await wait_until_async(lambda: len(runner.server.connections) == 3,
                               "the listener to hold the 3 connections")
        for _ in range(3):  # with a request sent, the answer still arrives before the close
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = await _response(reader)
            assert head.startswith(b"HTTP/1.1 503 ") and body["error_type"] == "overloaded"
            assert await _answer(reader) == b""
            writer.close()
        # one of the held connections leaves: a new one is served
        held[0][1].close()
        await wait_until_async(lambda: len(runner.server.connections) == 2,
                               "the listener to let the closed connection go")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close'
                     b'\r\n\r\n{"a": 1}')
        answer = await _answer(reader)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"a": 1}')
        for _, w in held[1:]:
            w.close()
    finally:
        await _stop(runner, listener)


@pytest.mark.parametrize("sent", [b"", b"POST /echo HTTP/1.1\r\nHost: x\r\n"])
async def test_a_connection_that_sends_no_whole_request_is_closed(sent):
    runner, listener, port = await _serve(keepalive_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        started = time.perf_counter()
        assert await _answer(reader) == b""  # closed without an answer
        assert time.perf_counter() - started < 3
    finally:
        await _stop(runner, listener)


async def test_a_body_that_does_not_arrive_is_a_408_and_closes(monkeypatch):
    monkeypatch.setattr(json_body, "BODY_TIMEOUT", 0.3)
    runner, listener, port = await _serve()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"a": ')
        head, body = await _response(reader)
        assert head.startswith(b"HTTP/1.1 408 ") and body["error_type"] == "timeout", head
        assert await _answer(reader) == b""  # and closed: the rest of the body is not read
    finally:
        await _stop(runner, listener)


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999999\r\n\r\n")
        # answered at once, with no body sent (aiohttp then reads and drops what comes for a
        # while before it closes the connection)
        head, body = await _response(reader)
        assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head, head
        assert body["error_type"] == "payload_limit" and "exceeded" in body["error"]
        writer.close()
        reply = await client.post("/generate", json={"inputs": "hi",
                                                     "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200
    finally:
        await client.close()


def test_the_ceiling_leaves_room_under_the_file_limit():
    assert connections.connection_ceiling(1024) == 1024 - 256
    assert connections.connection_ceiling(20_000) == 18_000
    assert connections.connection_ceiling(100) == 32
    assert connections.raise_file_limit() >= 1


class _Loop:
    def __init__(self):
        self.passed = []

    def default_exception_handler(self, context):
        self.passed.append(context)


def test_accept_failures_are_logged_once_a_minute_without_a_traceback(caplog):
    handler, loop = connections.QuietAcceptErrors(), _Loop()
    context = {"message": "socket.accept() out of system resource",
               "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.WARNING, logger="tgi.router"):
        for _ in range(1000):
            handler(loop, context)
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
    assert "Too many open files" in caplog.text and handler.suppressed == 999
    other = {"message": "Task exception was never retrieved"}
    handler(loop, other)
    assert loop.passed == [other]  # everything else goes to asyncio's own handler


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"])
async def test_a_request_that_does_not_parse_is_a_400_and_one_warning_line(caplog, request_bytes):
    runner, listener, port = await _serve()
    try:
        with caplog.at_level(logging.INFO):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes)
            answer = await _answer(reader)
            assert answer.split(b" ")[1] == b"400", answer
        records = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert records and all(r.levelno == logging.WARNING and not r.exc_info and not r.exc_text
                               for r in records), caplog.text
        assert "Traceback" not in caplog.text
    finally:
        await _stop(runner, listener)
