"""A shard's DecodeStream over gRPC: each step a message as it ends, the same tokens as Decode, the
shard's errors as their status codes, and a stream the caller abandons leaves the shard serving."""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shard(tiny_llama):
    prefix = f"/tmp/tgi-py-stream-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen([sys.executable, "-m", "shard", "--model-path", str(tiny_llama),
                                "--uds-path", prefix, "--dtype", "float32", "--block-size", "4"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{prefix}-0"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(process.stderr.read().decode()[-3000:])
        time.sleep(0.1)
    yield f"unix://{prefix}-0"
    process.terminate()
    assert process.wait(timeout=30) == 0


def _batch(batch_id: int, first_request: int) -> pb.Batch:
    requests = [pb.Request(id=first_request + i, input_ids=ids, blocks=blocks,
                           parameters=pb.NextTokenChooserParameters(),
                           stopping_parameters=pb.StoppingCriteriaParameters(
                               max_new_tokens=n, ignore_eos_token=True))
                for i, (ids, blocks, n) in enumerate((
                    ([5, 6, 7, 8], [1 + 10 * first_request, 2 + 10 * first_request,
                                    3 + 10 * first_request, 4 + 10 * first_request], 10),
                    ([9, 10], [5 + 10 * first_request, 6 + 10 * first_request,
                               7 + 10 * first_request, 8 + 10 * first_request], 7)))]
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


async def _warm(stub) -> None:
    """A KV pool of 4,096 tokens (each test starts from an empty one)."""
    await stub.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0), max_input_tokens=8,
                                       max_prefill_tokens=16, max_total_tokens=32,
                                       max_batch_total_tokens=4096))


async def _tokens(stub, batch_id: int, first: int, *, stream: bool) -> tuple[dict, list]:
    """Each request's tokens, prefill then calls of up to 4 steps; the messages per call."""
    reply = await stub.Prefill(pb.PrefillRequest(batch=_batch(batch_id, first)))
    tokens = {g.request_id: list(g.tokens.ids) for g in reply.generations}
    cached, per_call = reply.batch, []
    while reply.HasField("batch"):
        request = pb.DecodeRequest(batches=[cached], max_steps=4)
        if stream:
            messages = [m async for m in stub.DecodeStream(request)]
        else:
            messages = [await stub.Decode(request)]
        per_call.append([(m.more, m.steps, m.HasField("batch")) for m in messages])
        for message in messages:
            for g in message.generations:
                tokens[g.request_id] += list(g.tokens.ids)
        reply = messages[-1]
        finished = {g.request_id for g in reply.generations if g.HasField("generated_text")}
        if reply.HasField("batch"):
            alive = [r for r in reply.batch.request_ids if r not in finished]
            if len(alive) < len(reply.batch.request_ids):
                filtered = await stub.FilterBatch(pb.FilterBatchRequest(
                    batch_id=reply.batch.id, request_ids=alive))
                cached = filtered.batch
            else:
                cached = reply.batch
    return tokens, per_call


async def test_a_streamed_call_sends_each_step_and_the_tokens_of_decode(shard):
    async with grpc.aio.insecure_channel(shard) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        await _warm(stub)
        unary, _ = await _tokens(stub, 1, 0, stream=False)
        streamed, per_call = await _tokens(stub, 2, 2, stream=True)
        assert list(streamed.values()) == list(unary.values())
        assert [len(t) for t in streamed.values()] == [10, 7]
        # 7 tokens: the prefill's and 6 steps, 4 then 2 (the call ends where one finished);
        # then the other's last 3
        assert per_call == [[(True, 0, False)] * 3 + [(False, 4, True)],
                            [(True, 0, False), (False, 2, True)],
                            [(True, 0, False)] * 2 + [(False, 3, False)]]


async def test_errors_keep_their_codes_and_an_abandoned_stream_leaves_the_shard_serving(shard):
    async with grpc.aio.insecure_channel(shard) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        await _warm(stub)
        missing = pb.DecodeRequest(batches=[pb.CachedBatch(id=4242)], max_steps=4)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [m async for m in stub.DecodeStream(missing)]
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        reply = await stub.Prefill(pb.PrefillRequest(batch=_batch(3, 4)))
        call = stub.DecodeStream(pb.DecodeRequest(batches=[reply.batch], max_steps=4))
        first = await call.read()
        assert first.more
        call.cancel()
        # the call ran on to its end on the shard: the batch is there, whole, for the next one
        await stub.ClearCache(pb.ClearCacheRequest(id=3))
        again, _ = await _tokens(stub, 5, 6, stream=True)
        assert [len(t) for t in again.values()] == [10, 7]


async def test_the_routers_client_streams_a_call_from_a_real_shard(shard):
    from router.shards.client import ShardClient, ShardedClient
    from router.shards.step_types import CachedBatch

    client = ShardedClient([ShardClient(shard)])
    try:
        await client.info()
        stub = pb_grpc.TextGenerationServiceStub(client.clients[0].channel)
        await _warm(stub)
        reply = await stub.Prefill(pb.PrefillRequest(batch=_batch(7, 8)))
        handed = []
        result = await client.decode([CachedBatch(7, list(reply.batch.request_ids))], 4,
                                     handed.append)
        assert len(handed) == 3 and result.steps == 4
        ids = [[g.events[0].token.id for g in step.generations] for step in handed]
        ids.append([g.events[0].token.id for g in result.generations])
        unary, _ = await _tokens(stub, 9, 10, stream=False)  # the same prompts
        assert [[row[i] for row in ids] for i in range(2)] == [t[1:5] for t in unary.values()]
        await stub.ClearCache(pb.ClearCacheRequest())
    finally:
        await client.close()
