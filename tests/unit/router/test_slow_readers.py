"""Clients that stop reading their stream, against the batching loop on a fake shard: the slot is
let go of when the generation ends, a reader too far behind ends its request (blocks freed), a
fan-out runs at most the bound ahead of its reader, and the HTTP stream driver cuts a connection
whose client takes nothing within --stream-write-timeout."""
import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.core.generation import Infer
from router.errors import OverloadedError, SlowReaderError
from router.http.sse import WRITE_TIMEOUT, StreamFormat, serve_stream
from router.schemas import Token, TokenEvent
from tests.fakes import FakeShardClient
from tests.unit.router.test_batcher import _request, _setup, _with_loop
from tests.waiting import wait_until_async


def _infer(batcher, metrics, **kwargs) -> Infer:
    return Infer(batcher, metrics, **{"max_concurrent_requests": 1, **kwargs})


async def test_the_slot_is_free_once_the_generation_ends_though_nothing_was_read():
    client = FakeShardClient(step_delay=0.001)
    batcher, _, allocator = _setup(client)
    infer = _infer(batcher, batcher.metrics)

    async def scenario():
        unread = infer.stream(_request(max_new_tokens=6))
        await anext(unread)  # admitted and running; its reader takes nothing more
        with pytest.raises(OverloadedError):  # the one slot is taken while it generates
            await infer.generate(_request(max_new_tokens=1))
        await wait_until_async(lambda: infer.in_flight == 0, "the generation to end")
        assert (await infer.generate(_request(max_new_tokens=2))).final.generated_tokens == 2
        assert allocator.num_free_blocks == allocator.num_usable_blocks
        # the unread events are still there for a reader that comes back
        rest = [event async for event in unread]
        assert [e.token.id for e in rest] == [2, 3, 4, 5, 6] and rest[-1].final is not None

    await _with_loop(batcher, scenario())


async def test_a_reader_too_far_behind_ends_its_request_and_frees_its_blocks():
    client = FakeShardClient(step_delay=0.001)
    batcher, _, allocator = _setup(client)
    infer = _infer(batcher, batcher.metrics, max_concurrent_requests=4, max_unread_events=8)

    async def scenario():
        unread = infer.stream(_request(max_new_tokens=150))
        await anext(unread)
        other = asyncio.ensure_future(infer.generate(_request(max_new_tokens=30)))
        await wait_until_async(lambda: infer.in_flight == 0 and other.done(),
                               "the unread request to end, and the other to finish")
        assert other.result().final.generated_tokens == 30
        assert allocator.num_free_blocks == allocator.num_usable_blocks
        got = []
        with pytest.raises(SlowReaderError, match="stopped reading"):
            async for event in unread:
                got.append(event)
        assert 8 <= len(got) < 20, "ended once 8 events waited unread, not at its 150 tokens"
        counters = batcher.metrics.counters
        assert counters.value("tgi_request_failure", err="slow_reader") == 1

    await _with_loop(batcher, scenario())
    assert infer.in_flight == 0


async def test_a_fan_out_runs_at_most_the_bound_ahead_of_its_reader():
    client = FakeShardClient(step_delay=0.001)
    batcher, _, allocator = _setup(client)
    infer = _infer(batcher, batcher.metrics, max_concurrent_requests=4, max_unread_events=6)
    seen = []

    async def scenario():
        merged = infer.stream_many([_request(100), _request(100)],
                                   on_event=lambda index, event: seen.append(index))
        await anext(merged)
        # the reader stops: the pumps wait once 6 events are queued for it, and the requests'
        # own queues fill until the scheduler ends them
        await wait_until_async(lambda: infer.in_flight == 0, "both requests to end")
        assert allocator.num_free_blocks == allocator.num_usable_blocks
        assert len(seen) <= 6 + 2
        with pytest.raises(SlowReaderError):
            async for _ in merged:
                pass

    await _with_loop(batcher, scenario())


class _Big(StreamFormat):
    """Frames of 64 KB: a few dozen fill any socket buffer."""

    def event(self, index, event):
        return [b"x" * 65536]

    def error(self, err):
        return b"error\n"


async def test_a_client_that_takes_nothing_is_cut_after_the_write_timeout():
    closed = asyncio.Event()

    async def events():
        try:
            while True:
                await asyncio.sleep(0)
                yield 0, TokenEvent(Token(1, "x", None))
        finally:
            closed.set()

    async def handler(request):
        return await serve_stream(request, events(), _Big())

    app = web.Application()
    app[WRITE_TIMEOUT] = 0.5
    app.router.add_get("/", handler)
    server = TestServer(app)
    await server.start_server()
    peer = socket.socket()
    try:
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(peer, (server.host, server.port))
        await loop.sock_sendall(peer, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # it reads nothing: within the timeout (after the buffers fill) the stream is cut and
        # its events closed, which is what cancels a generation
        await asyncio.wait_for(closed.wait(), timeout=10)
        received = 0
        while chunk := await asyncio.wait_for(loop.sock_recv(peer, 1 << 20), timeout=10):
            received += len(chunk)
        assert received > 65536  # what the buffers held, then the end of the connection
    except ConnectionResetError:
        pass  # the cut may arrive as a reset, with the unread bytes dropped
    finally:
        peer.close()
        await server.close()
