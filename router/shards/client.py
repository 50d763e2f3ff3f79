"""gRPC clients of the shards: one per rank, fanned out so every rank runs every call in lock-step.

The scheduler calls it with the router's own types (router.shards.step_types); router.shards.convert translates.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import numpy

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.tracing import inject_metadata, tracing_enabled
from router.shards import convert
from router.shards.convert import AdapterInfo, ShardInfo
from router.shards.step_types import CachedBatch, NewBatch, PreparedBatch, Rejection, StepResult


class ShardError(Exception):
    """A shard call failed.

    The message is the shard's own, `code` its gRPC status's name (INVALID_ARGUMENT, ...; None when
    the call never got an answer)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class ShardClient:
    def __init__(self, target: str):
        """A client of one rank at `target`.

        `target`: a gRPC target as a shard's service discovery gives it (`unix:///path` for a
        rank on this machine, `host:port` for one on another), or an absolute socket path."""
        self.target = f"unix://{target}" if target.startswith("/") else target
        self.channel = grpc.aio.insecure_channel(
            self.target,
            options=[("grpc.max_receive_message_length", 2**31 - 1),
                     ("grpc.max_send_message_length", 2**31 - 1),
                     # shards are ours, on this machine or a peer: gRPC would send a TCP
                     # target through http_proxy (or grpc_proxy, https_proxy) where one is set
                     ("grpc.enable_http_proxy", 0)])
        self.stub = pb_grpc.TextGenerationServiceStub(self.channel)

    async def call(self, method: str, message, timeout: float | None = None, metadata=None):
        try:
            return await getattr(self.stub, method)(message, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            raise ShardError(err.details() or err.code().name, err.code().name) from None

    async def stream(self, method: str, message, metadata=None) -> AsyncIterator:
        """A server-streaming call's messages; closing the iterator cancels the call."""
        try:
            async for reply in getattr(self.stub, method)(message, metadata=metadata):
                yield reply
        except grpc.aio.AioRpcError as err:
            raise ShardError(err.details() or err.code().name) from None
        except Exception as err:  # as call(): any failure of the channel is the shard's
            raise ShardError(str(err)) from err

    async def close(self) -> None:
        await self.channel.close()


class ShardedClient:
    """Sends each call to every rank and answers with rank 0's reply (ranks compute the same)."""

    def __init__(self, clients: list[ShardClient]):
        self.clients = clients
        # each rank's process id as it answered when connected: another id is a restarted rank
        self.instance_ids: list[str] = []
        self.hidden_size = 0  # from info(), which the router asks before any step

    @classmethod
    async def connect(cls, master_socket: str, timeout: float = 30.0) -> "ShardedClient":
        client = cls([])
        await client.reconnect(master_socket, timeout)
        return client

    async def reconnect(self, master_socket: str, timeout: float = 30.0) -> None:
        """New channels to every rank (after a restart of the group), and their instance ids."""
        master = ShardClient(master_socket)
        try:
            reply = await master.call("ServiceDiscovery", pb.ServiceDiscoveryRequest(),
                                      timeout=timeout)
        finally:
            await master.close()
        clients = [ShardClient(url) for url in reply.urls]
        try:
            instance_ids = await _instance_ids(clients, timeout)
        except ShardError:
            await asyncio.gather(*(c.close() for c in clients))
            raise
        old, self.clients, self.instance_ids = self.clients, clients, instance_ids
        await asyncio.gather(*(c.close() for c in old))

    async def is_same_group_alive(self, timeout: float = 2.0) -> bool:
        """Whether every rank answers and is still the process the router connected to.

        Never raises: the batching loop asks it, and a broken channel only means "no"."""
        try:
            return await _instance_ids(self.clients, timeout) == self.instance_ids
        except Exception:
            return False

    async def _all(self, method: str, message, timeout: float | None = None):
        return (await self._each(method, message, timeout))[0]

    async def _each(self, method: str, message, timeout: float | None = None) -> list:
        """Every rank's reply, rank order."""
        # the current span (if any) becomes the parent of the shards' spans
        metadata = inject_metadata() if tracing_enabled() else None
        replies = await asyncio.gather(*(c.call(method, message, timeout, metadata)
                                         for c in self.clients), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply if isinstance(reply, ShardError) else ShardError(str(reply))
        return replies

    async def info(self) -> ShardInfo:
        info = convert.shard_info(await self._all("Info", pb.InfoRequest(), timeout=30))
        self.hidden_size = info.hidden_size
        return info

    async def health(self, timeout: float = 5.0) -> None:
        await self._all("Health", pb.HealthRequest(), timeout=timeout)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._all("ClearCache", request)

    async def embed(self, inputs: list[tuple[int, list[int], int, int | None]]
                    ) -> tuple[dict[int, numpy.ndarray], dict[int, str], int]:
        """Pooled vectors: (id -> vector of each input ended, id -> why refused, forward ns).

        Each input is (id, token ids, tokens computed before, tokens now or None: to its end)."""
        message = pb.EmbedRequest(inputs=[
            pb.EmbedInput(id=i, input_ids=ids, cache_len=start, chunk_len=chunk)
            if chunk is not None else pb.EmbedInput(id=i, input_ids=ids, cache_len=start)
            for i, ids, start, chunk in inputs])
        reply = await self._all("Embed", message)
        return ({e.id: numpy.array(e.values, dtype=numpy.float32) for e in reply.embeddings},
                {r.request_id: r.reason for r in reply.rejected}, reply.forward_ns)

    async def warmup(self, batch: NewBatch, **limits: int) -> int:
        """Runs the warm-up batch on every rank; returns the KV pool's size in blocks.

        The smallest rank's: every rank must fit."""
        request = convert.warmup_message(batch, **limits)
        replies = await asyncio.gather(*(c.call("Warmup", request) for c in self.clients))
        return min(r.num_blocks for r in replies)

    def prepare(self, batch: NewBatch) -> tuple[PreparedBatch, list[Rejection]]:
        """The batch's message, and the requests that could not be put into it.

        Each fails alone, before anything is sent."""
        message, rejected = convert.batch_message(batch)
        return PreparedBatch([r.id for r in message.requests], message), rejected

    async def prefill(self, prepared: PreparedBatch,
                      running: CachedBatch | None = None) -> StepResult:
        """New requests, with `running` taking its decode step in the same forward."""
        cached = convert.cached_batch_message(running) if running is not None else None
        return convert.step_result(await self._all(
            "Prefill", pb.PrefillRequest(batch=prepared.message, cached_batch=cached)),
            self.hidden_size)

    async def decode(self, batches: list[CachedBatch], max_steps: int = 1,
                     on_step: Callable[[StepResult], None] | None = None) -> StepResult:
        """Up to `max_steps` decode steps back to back.

        The shards stop after one where a request finished. With `on_step`, every step but the last
        is handed to it as it ends (streamed from the shards), and the result holds the last step's
        generations with the whole call's steps and times; without, every step's tokens come in the
        result."""
        request = pb.DecodeRequest(batches=[convert.cached_batch_message(b) for b in batches],
                                   max_steps=max_steps)
        if on_step is None or max_steps <= 1:
            replies = await self._each("Decode", request)
        else:
            replies = await self._streamed(request, on_step)
        # each rank ends the call on its own tokens, the same on every rank; ranks that parted
        # would pair their collectives with the wrong step
        if len({r.steps for r in replies}) > 1:
            raise ShardError("the shard ranks took different numbers of decode steps: "
                             f"{[r.steps for r in replies]}")
        return convert.step_result(replies[0], self.hidden_size)

    async def _streamed(self, request: pb.DecodeRequest,
                        on_step: Callable[[StepResult], None]) -> list:
        """DecodeStream on rank 0 and Decode on the others.

        Rank 0's steps are handed to on_step as they come; the other ranks compute the same steps,
        and only rank 0's tokens are read. Returns every rank's last message, rank order. An error
        in on_step is the router's own and is raised as it is; the calls are cancelled then."""
        metadata = inject_metadata() if tracing_enabled() else None
        others = [asyncio.ensure_future(c.call("Decode", request, None, metadata))
                  for c in self.clients[1:]]
        stream = self.clients[0].stream("DecodeStream", request, metadata)
        try:
            last = None
            async for reply in stream:
                if reply.more:
                    on_step(convert.step_result(reply, self.hidden_size))
                else:
                    last = reply
            if last is None:
                raise ShardError("the shard ended a decode stream without its last message")
            return [last, *await asyncio.gather(*others)]
        finally:
            await stream.aclose()
            for other in others:
                other.cancel()

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        reply = await self._all("FilterBatch",
                                pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids))
        return convert.cached_batch(reply.batch)

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Loads the LoRA adapter in directory `path` under `name` on every rank.

        When a rank refuses it, the ranks that took it let go of it again, so that all agree, and
        the refusal is raised (the first rank's that refused, in rank order)."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        replies = await asyncio.gather(*(c.call("LoadAdapter", request) for c in self.clients),
                                       return_exceptions=True)
        failures = [r for r in replies if isinstance(r, BaseException)]
        if not failures:
            return convert.adapter_info(replies[0])
        loaded = [c for c, r in zip(self.clients, replies) if not isinstance(r, BaseException)]
        await asyncio.gather(*(c.call("UnloadAdapter", pb.UnloadAdapterRequest(name=name))
                               for c in loaded), return_exceptions=True)
        first = failures[0]
        raise first if isinstance(first, ShardError) else ShardError(str(first))

    async def unload_adapter(self, name: str) -> None:
        """Frees adapter `name` on every rank.

        A rank that does not have it (NOT_FOUND: it restarted, or a load failed half-way) is already
        where the others go."""
        request = pb.UnloadAdapterRequest(name=name)
        replies = await asyncio.gather(*(c.call("UnloadAdapter", request) for c in self.clients),
                                       return_exceptions=True)
        for reply in replies:
            if isinstance(reply, ShardError) and reply.code == "NOT_FOUND":
                continue
            if isinstance(reply, BaseException):
                raise reply if isinstance(reply, ShardError) else ShardError(str(reply))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


async def _instance_ids(clients: list[ShardClient], timeout: float) -> list[str]:
    replies = await asyncio.gather(*(c.call("Health", pb.HealthRequest(), timeout)
                                     for c in clients))
    return [r.instance_id for r in replies]
