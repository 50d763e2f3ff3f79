"""A failed step on CUDA: what stops the shard (a device that no longer runs work) and what fails
only its batch (running out of memory, a shape or argument error)."""
import asyncio

import grpc
import pytest
import torch

from shard.server import ShardServicer


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.code = None

    async def abort(self, code, details):
        self.code = code
        raise _Aborted(details)


class _Engine:
    class runner:
        device = torch.device("cuda")


def _servicer(monkeypatch, device_lost: bool):
    fatal = []
    servicer = ShardServicer.__new__(ShardServicer)  # no engine thread or model needed
    servicer.engine, servicer.on_fatal_error, servicer._worker = _Engine(), fatal.append, None
    monkeypatch.setattr(ShardServicer, "_device_lost", lambda self: device_lost)
    emptied = servicer.emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    return servicer, fatal


def _fail(servicer, error):
    def step():
        raise error
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer._call(context, step))
    return context.code


@pytest.mark.parametrize("device_lost", [False, True])
def test_out_of_memory_fails_the_batch_and_keeps_the_shard(monkeypatch, device_lost):
    servicer, fatal = _servicer(monkeypatch, device_lost)
    assert _fail(servicer, torch.cuda.OutOfMemoryError("CUDA out of memory")) == \
        grpc.StatusCode.INTERNAL
    assert fatal == []


def test_a_runtime_error_stops_the_shard_only_when_the_device_is_lost(monkeypatch):
    servicer, fatal = _servicer(monkeypatch, device_lost=False)
    _fail(servicer, RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert fatal == []
    servicer, fatal = _servicer(monkeypatch, device_lost=True)
    error = RuntimeError("CUDA error: device-side assert triggered")
    _fail(servicer, error)
    assert fatal == [error]


@pytest.mark.parametrize("device_lost", [False, True])
@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO), out of memory")])
def test_an_allocation_failure_outside_the_allocator_empties_the_cache(monkeypatch, error,
                                                                      device_lost):
    servicer, fatal = _servicer(monkeypatch, device_lost=device_lost)
    assert _fail(servicer, error) == grpc.StatusCode.INTERNAL
    assert servicer.emptied == [True]
    assert fatal == ([error] if device_lost else [])  # a device left broken still stops the shard


class _CpuEngine:
    class runner:
        device = torch.device("cpu")


def test_a_failed_collective_stops_the_shard_on_any_device(monkeypatch):
    from shard import distributed

    monkeypatch.setattr(distributed.dist, "all_reduce", _raise_gloo)
    context = distributed.ParallelContext(rank=0, world_size=2, group=object())
    with pytest.raises(distributed.CollectiveFailed, match="pair closure") as caught:
        distributed.all_reduce(torch.ones(2), context)
    for engine in (_Engine(), _CpuEngine()):
        servicer, fatal = _servicer(monkeypatch, device_lost=False)
        servicer.engine = engine
        _fail(servicer, caught.value)
        assert fatal == [caught.value]  # gloo's group is closed for good: a new one is needed


def _raise_gloo(*args, **kwargs):
    raise RuntimeError("Application timeout caused pair closure")
