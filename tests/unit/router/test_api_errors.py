"""HTTP error shapes with the real app over a scripted shard: 424, SSE error events, 429, 500."""
import asyncio
import json
import tempfile

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app, router_state
from router.config import router_config
from router.core.generation import Infer
from router.inputs.chat_template import ChatTemplate
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import TokenLimits, ValidationLimits
from router.kv.accounting import kv_accounting
from router.lifecycle.served_model import ServedModel
from router.lifecycle.sessions import RequestSessions
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.request_queue import RequestQueue
from router.shards.convert import ShardInfo
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient
from tests.openapi_schemas import assert_matches
from tests.waiting import wait_until_async


class HealthyFake(FakeShardClient):
    async def health(self):
        return None

    async def close(self):
        return None


async def _client(tiny_llama, fake, *, max_concurrent=8, max_total_tokens=128, vocab_size=0,
                  **options) -> TestClient:
    # adapters made under the temporary directory may be loaded, as --allowed-local-model-path
    # would allow them
    options.setdefault("allowed_local_model_path", tempfile.gettempdir())
    settings = router_config({"tokenizer_path": str(tiny_llama),
                              "max_concurrent_requests": max_concurrent, **options})
    config = settings.model
    state = router_state(settings.server, config)
    max_input = max_total_tokens // 2
    limits = TokenLimits(max_input_tokens=max_input, max_total_tokens=max_total_tokens,
                         max_batch_prefill_tokens=max(256, max_total_tokens))
    kv = kv_accounting(max(200, max_total_tokens // 2), 4, prefix_caching=False)
    allocator = kv.allocator
    metrics = Metrics(max_input_tokens=max_input, max_total_tokens=max_total_tokens)
    batcher = Batcher(fake, RequestQueue(allocator), allocator,
                      SchedulingLimits(256, 800, 0.3, 20, None), metrics, sessions=kv.sessions)
    tokenizer = RouterTokenizer(str(tiny_llama))
    infer = Infer(batcher, metrics, max_concurrent_requests=max_concurrent)
    sessions = RequestSessions(kv.sessions, infer, tokenizer, limits,
                               refresh_gauges=batcher.running.update_gauges)
    served = ServedModel(config, tokenizer, fake,
                         ShardInfo(dtype="float32", device_type="cpu", world_size=1, block_size=4,
                                   max_position_embeddings=max_total_tokens,
                                   support_chunking=False,
                                   use_prefix_caching=False, hidden_size=8,
                                   vocab_size=vocab_size), limits,
                         ValidationLimits(limits, 2, 4, 5, vocab_size), allocator, batcher,
                         infer, metrics, ChatTemplate.from_model_dir(str(tiny_llama)),
                         sessions=sessions, adapter_links=state.models.adapter_links)
    state.models.add_default(served)
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    return client


def _body(max_new_tokens=3):
    return {"inputs": "hello", "parameters": {"max_new_tokens": max_new_tokens}}


async def test_generation_error_is_424_with_tgi_body(tiny_llama):
    fake = HealthyFake()
    fake.fail_next = "prefill"
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/generate", json=_body())
        assert reply.status == 424
        assert await reply.json() == {
            "error": "Request failed during generation: Server error: injected prefill failure",
            "error_type": "generation"}
        reply = await client.post("/generate", json=_body())
        assert reply.status == 200, "the server recovers for the next request"
    finally:
        await client.close()


async def test_error_after_the_stream_opened_is_an_sse_error_event(tiny_llama):
    fake = HealthyFake(step_delay=0.01)
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/generate_stream", json=_body(max_new_tokens=10))
        assert reply.status == 200
        first = await reply.content.readline()
        assert first.startswith(b"data:{")
        fake.fail_next = "decode"
        text = (await reply.content.read()).decode()
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        assert events[-1] == {"error": "Request failed during generation: Server error: injected "
                                       "decode failure", "error_type": "generation"}
    finally:
        await client.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"})])
async def test_an_error_in_an_open_v1_stream_is_tgis_error_body(tiny_llama, path, body):
    """As TGI writes it on its /v1 streams (huggingface_hub raises its message), then [DONE]."""
    fake = HealthyFake(step_delay=0.01)
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post(path, json={**body, "max_tokens": 10, "stream": True})
        assert reply.status == 200
        assert (await reply.content.readline()).startswith(b"data: {")
        fake.fail_next = "decode"
        text = (await reply.content.read()).decode()
        frames = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2]) == {
            "error": "Request failed during generation: Server error: injected decode failure",
            "error_type": "generation"}
        assert_matches("ErrorResponse", json.loads(frames[-2]))
    finally:
        await client.close()


async def test_overload_is_429_and_validation_is_answered_before_the_stream(tiny_llama):
    fake = HealthyFake(step_delay=0.05)
    client = await _client(tiny_llama, fake, max_concurrent=1)
    try:
        slow = asyncio.ensure_future(client.post("/generate", json=_body(max_new_tokens=20)))
        await wait_until_async(lambda: fake.generated, "the slow request to be running")
        reply = await client.post("/generate_stream", json=_body())
        assert reply.status == 429
        assert await reply.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        reply = await client.post("/generate_stream", json={"inputs": "x",
                                                            "parameters": {"top_k": 0}})
        assert reply.status == 422
        assert (await reply.json())["error_type"] == "validation"
        assert (await slow).status == 200
    finally:
        await client.close()


async def test_metrics_use_tgi_names(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        assert (await client.post("/generate", json=_body())).status == 200
        assert (await client.post("/generate", json={"inputs": ""})).status == 422
        text = await (await client.get("/metrics")).text()
        for line in ("tgi_request_count 2.0", "tgi_request_success 1.0",
                     'tgi_request_failure{err="validation"} 1.0',
                     'tgi_batch_inference_count{method="prefill"} 1.0',
                     "# TYPE tgi_request_count counter", "tgi_request_duration_bucket",
                     "tgi_request_queue_duration_count 1.0", "tgi_request_generated_tokens_sum 3.0",
                     "tgi_batch_max_total_tokens 796.0", "tgi_queue_size 0.0"):
            assert line in text, line
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_malformed_json_and_non_utf8_are_422_in_tgi_shape(tiny_llama, path):
    client = await _client(tiny_llama, HealthyFake())
    try:
        for data in (b"{not json", b"\xff\xfe{}", b"[1, 2]"):
            reply = await client.post(path, data=data)
            assert reply.status == 422
            body = await reply.json()
            assert body["error_type"] == "validation" and body["error"]
    finally:
        await client.close()


async def test_api_key_guards_every_route_but_health_and_metrics(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    try:
        for method, path in (("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"),
                             ("POST", "/tokenize"), ("GET", "/info"),
                             ("GET", "/api-doc/openapi.json")):
            reply = await client.request(method, path, json=_body())
            assert reply.status == 401, path
            assert (await reply.json())["error_type"] == "authentication"
            wrong = await client.request(method, path, json=_body(),
                                         headers={"Authorization": "Bearer nope"})
            assert wrong.status == 401
        ok = await client.post("/generate", json=_body(), headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_payload_over_the_limit_is_413_in_tgi_shape(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), payload_limit=1000)
    try:
        reply = await client.post("/generate", json={"inputs": "x" * 2000})
        assert reply.status == 413
        body = await reply.json()
        assert body["error_type"] == "payload_limit" and "Payload too large" in body["error"]
        assert (await client.post("/generate", json=_body())).status == 200
    finally:
        await client.close()


async def test_cors_allows_listed_origins_only(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), cors_allow_origin="https://app.example")
    try:
        allowed = await client.options("/generate", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert allowed.status == 204
        assert allowed.headers["Access-Control-Allow-Origin"] == "https://app.example"
        asking = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization, x-stainless-os"})
        assert asking.headers["Access-Control-Allow-Headers"] == \
            "content-type, authorization, x-stainless-os"  # the OpenAI SDK's, in a browser
        reply = await client.post("/generate", json=_body(), headers={"Origin": "https://app.example"})
        assert reply.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = await client.post("/generate", json=_body(), headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
        # a stream's headers go out before its handler returns: they carry CORS's too
        for path, body in (("/generate_stream", _body()),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True})):
            stream = await client.post(path, json=body, headers={"Origin": "https://app.example"})
            assert stream.headers["Access-Control-Allow-Origin"] == "https://app.example", path
            await stream.read()
        refused = await client.post("/generate", json={"inputs": ""},
                                    headers={"Origin": "https://app.example"})
        assert refused.status == 422
        assert refused.headers["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        await client.close()


@pytest.mark.parametrize("path,body", [
    ("/generate_stream", _body()), ("/", {**_body(), "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})])
async def test_a_finished_stream_counts_as_a_success(tiny_llama, path, body):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post(path, json=body)
        assert reply.status == 200
        await reply.read()
        metrics = await (await client.get("/metrics")).text()
        assert "tgi_request_success 1.0" in metrics, "a stream read to its end is a success"
        assert "tgi_request_failure" not in metrics.replace("# HELP tgi_request_failure", "")\
            .replace("# TYPE tgi_request_failure", "")
    finally:
        await client.close()
