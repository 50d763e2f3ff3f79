"""LoadAdapter: the files are read on a thread of their own while the engine thread serves, and an
adapter refused answers its own call with the reason."""
import asyncio
import threading

import grpc
import pytest

from proto import generate_pb2 as pb
from shard.adapters.adapter_set import LoadedAdapter
from shard.adapters.peft_files import AdapterError
from shard.server import ShardServicer, engine_thread
from tests.unit.shard.test_server_errors import _Aborted, _Context


class _Engine:
    """Reads with `read`; records the thread each install ran on."""

    def __init__(self, read):
        self.read_adapter = read
        self.installed = []

    def install_adapter(self, name, adapter):
        self.installed.append((name, adapter, threading.current_thread().name))
        return LoadedAdapter(name, 0, 8, 16.0, 2.0, ["q_proj"], "", 8)


@pytest.fixture
def serve():
    made = []

    def servicer(read) -> ShardServicer:
        made.append(ShardServicer(_Engine(read), None, None, lambda err: None, engine_thread(),
                                  []))
        return made[-1]

    yield servicer
    for servicer in made:
        servicer._worker.shutdown()
        servicer._reader.shutdown()


async def test_adapter_files_are_read_while_the_engine_thread_serves(serve):
    reading, release, readers = threading.Event(), threading.Event(), []

    def read(name, path):
        readers.append(threading.current_thread().name)
        reading.set()
        assert release.wait(30)
        return f"{name} read from {path}"

    servicer = serve(read)
    load = asyncio.ensure_future(servicer.LoadAdapter(pb.LoadAdapterRequest(name="a", path="/x"),
                                                      _Context()))
    assert await asyncio.to_thread(reading.wait, 30)
    # the read holds its own thread: a step on the engine thread runs meanwhile
    step = servicer._call(_Context(), lambda: threading.current_thread().name)
    engine = await asyncio.wait_for(step, 10)
    assert not load.done()
    release.set()
    reply = await asyncio.wait_for(load, 10)
    assert reply.rank == 8 and reply.target_modules == ["q_proj"]
    assert readers[0].startswith("adapter-reader") and engine.startswith("engine")
    assert servicer.engine.installed == [("a", "a read from /x", engine)]


@pytest.mark.parametrize("error, code", [
    (AdapterError("/x: rank_pattern: key '(?=a)': a lookaround"), grpc.StatusCode.INVALID_ARGUMENT),
    (MemoryError("no room"), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
async def test_a_refused_adapter_answers_its_own_call(serve, error, code):
    def read(name, path):
        raise error

    servicer, context = serve(read), _Context()
    with pytest.raises(_Aborted) as aborted:
        await servicer.LoadAdapter(pb.LoadAdapterRequest(name="a", path="/x"), context)
    assert context.code == code and str(error) in str(aborted.value)
    assert servicer.engine.installed == []
