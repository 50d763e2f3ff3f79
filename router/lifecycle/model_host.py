"""The router's side of the launcher's ModelHost service (proto/model_host.proto).

Fetch a model's files, start and stop the shard group of a model.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from proto import model_host_pb2 as pb
from proto import model_host_pb2_grpc as pb_grpc


class ModelHostError(Exception):
    """The launcher refused or failed: the reason is its message."""


class ModelHostClient:
    def __init__(self, socket_path: str):
        self.channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        self.stub = pb_grpc.ModelHostStub(self.channel)

    async def pull(self, source: str, target_dir: str, *, revision: str | None = None,
                   adapter: bool = False, max_bytes: int = 0) -> AsyncIterator[pb.PullProgress]:
        """Fetches a model's or an adapter's files into `target_dir`; progress as it goes.

        A model's are converted to what the shards serve; with `adapter`, a LoRA adapter's are
        kept as they are, and refused before any is fetched when they hold more than
        `max_bytes` (0: no bound).
        """
        try:
            async for progress in self.stub.Pull(pb.PullRequest(
                    source=source, target_dir=target_dir, revision=revision, adapter=adapter,
                    max_bytes=max_bytes)):
                yield progress
        except grpc.aio.AioRpcError as err:
            raise ModelHostError(err.details() or err.code().name) from None

    async def start_group(self, name: str, model_dir: str, *, num_shard: int, dtype: str,
                          device: str, cpu_threads: int = 0) -> str:
        """Rank 0's socket of the model's started shard group.

        `cpu_threads`: each shard's CPU threads (0: the shard's own choice)."""
        try:
            reply = await self.stub.StartGroup(pb.StartGroupRequest(
                name=name, model_dir=model_dir, num_shard=num_shard, dtype=dtype, device=device,
                cpu_threads=cpu_threads))
        except grpc.aio.AioRpcError as err:
            raise ModelHostError(err.details() or err.code().name) from None
        return reply.master_uds_path

    async def stop_group(self, name: str) -> None:
        try:
            await self.stub.StopGroup(pb.StopGroupRequest(name=name))
        except grpc.aio.AioRpcError as err:
            raise ModelHostError(err.details() or err.code().name) from None

    async def groups(self) -> set[str]:
        try:
            reply = await self.stub.Groups(pb.GroupsRequest(), timeout=10)
        except grpc.aio.AioRpcError as err:
            raise ModelHostError(err.details() or err.code().name) from None
        return set(reply.names)

    async def close(self) -> None:
        await self.channel.close()
