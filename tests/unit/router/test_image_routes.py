"""Images through every API with the real app over a scripted shard: what reaches the shard, and 4xx."""
import hashlib
import json
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proto import generate_pb2 as pb
from router.app import create_app, router_state
from router.config import router_config
from router.core.generation import Infer
from router.inputs.chat_template import ChatTemplate
from router.inputs.images.family import image_family
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import TokenLimits, ValidationLimits
from router.kv.accounting import kv_accounting
from router.lifecycle.served_model import ServedModel
from router.lifecycle.sessions import RequestSessions
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.request_queue import RequestQueue
from router.schemas import GenerateRequest, PromptImage, SamplingParams, StoppingParams
from router.shards.convert import ShardInfo, request_message
from router.shards.step_types import ShardRequest
from router.telemetry.metrics import Metrics
from tests.image_files import data_url, image_bytes, truncated_png
from tests.openapi_schemas import answer_problems
from tests.tiny_models import build_tiny_gemma3_vlm
from tests.unit.router.test_api_errors import HealthyFake

CAT, DOG = image_bytes(9, 9, color=(1, 2, 3)), image_bytes(9, 9, color=(200, 100, 0))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm-routes"))


async def _client(model_dir, fake, **options) -> TestClient:
    settings = router_config({"tokenizer_path": str(model_dir), **options})
    config = settings.model
    state = router_state(settings.server, config)
    limits = TokenLimits(max_input_tokens=200, max_total_tokens=256, max_batch_prefill_tokens=256)
    kv = kv_accounting(200, 4, prefix_caching=True)
    metrics = Metrics(max_input_tokens=200, max_total_tokens=256)
    batcher = Batcher(fake, RequestQueue(kv.allocator, kv.prefix_cache), kv.allocator,
                      SchedulingLimits(256, 800, 0.3, 20, None), metrics, sessions=kv.sessions)
    tokenizer = RouterTokenizer(str(model_dir))
    images = image_family(str(model_dir), tokenizer.tokenizer.id_to_token)
    infer = Infer(batcher, metrics, max_concurrent_requests=8)
    sessions = RequestSessions(kv.sessions, infer, tokenizer, limits,
                               refresh_gauges=batcher.running.update_gauges, images=images)
    served = ServedModel(config, tokenizer, fake,
                         ShardInfo(dtype="float32", device_type="cpu", world_size=1, block_size=4,
                                   max_position_embeddings=256, support_chunking=False,
                                   use_prefix_caching=True, hidden_size=8), limits,
                         ValidationLimits(limits, 2, 4, 5), kv.allocator, batcher, infer, metrics,
                         ChatTemplate.from_model_dir(str(model_dir)), sessions=sessions,
                         adapter_links=state.models.adapter_links, images=images)
    state.models.add_default(served)
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    return client


def _chat(*images, text="what is it?", **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 2, **fields}


def _last(fake):
    return fake.requests[max(fake.requests)]


def _check_spans(shard_request, *files):
    """Each image over a run of 4 image tokens, with its file and digest."""
    request = shard_request.request
    assert [i.data for i in request.images] == list(files)
    for image, data in zip(request.images, files):
        assert image.digest == hashlib.sha256(data).digest() and image.token_count == 4
        span = request.input_ids[image.token_offset:image.token_offset + 4]
        assert len(set(span)) == 1 and span[0] == 324  # <image_soft_token>


async def test_a_chat_image_reaches_the_shard_over_its_tokens_and_is_cached_by_content(
        gemma3_dir):
    fake = HealthyFake()
    client = await _client(gemma3_dir, fake)
    try:
        reply = await client.post("/v1/chat/completions", json=_chat(CAT))
        assert reply.status == 200, await reply.text()
        first = _last(fake)
        _check_spans(first, CAT)
        tokens = await (await client.post("/chat_tokenize", json=_chat(CAT))).json()
        assert [t["id"] for t in tokens["tokenize_response"]] == first.request.input_ids
        assert (await reply.json())["usage"]["prompt_tokens"] == len(first.request.input_ids)
        # the same image again: its blocks come from the cache, past the image
        await client.post("/v1/chat/completions", json=_chat(CAT))
        image = first.request.images[0]
        assert _last(fake).cache_len >= image.token_offset + image.token_count
        # another image with the same ids: no block holding image tokens is reused
        await client.post("/v1/chat/completions", json=_chat(DOG))
        assert _last(fake).cache_len <= image.token_offset
        # an image URL given as a string, two images in one message
        body = _chat(DOG, CAT)
        body["messages"][0]["content"][0]["image_url"] = data_url(DOG)
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status == 200, await reply.text()
        _check_spans(_last(fake), DOG, CAT)
    finally:
        await client.close()


async def test_tgi_markdown_sglang_image_data_and_generate_one_sessions(gemma3_dir):
    fake = HealthyFake()
    client = await _client(gemma3_dir, fake)
    try:
        inputs = f"Look: ![]({data_url(CAT)}) and ![]({data_url(DOG)})"
        reply = await client.post("/generate", json={"inputs": inputs,
                                                     "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200, await reply.text()
        _check_spans(_last(fake), CAT, DOG)
        tokens = await (await client.post("/tokenize", json={"inputs": inputs})).json()
        assert [t["id"] for t in tokens] == _last(fake).request.input_ids
        # SGLang: one image, a list for one prompt, a list per prompt of a batch
        for body, expected in (
                ({"text": "a <start_of_image> b", "image_data": data_url(CAT)}, [[CAT]]),
                ({"text": "no marker: first", "image_data": [data_url(CAT), data_url(DOG)]},
                 [[CAT, DOG]]),
                ({"text": "", "image_data": {"url": data_url(DOG)}}, [[DOG]]),
                ({"text": ["x", "y", "z"], "image_data": [data_url(DOG), None,
                                                           [{"url": data_url(CAT)}]]},
                 [[DOG], [], [CAT]])):
            before = max(fake.requests)
            reply = await client.post("/generate", json={
                **body, "sampling_params": {"max_new_tokens": 2}, "modalities": ["image"]})
            assert reply.status == 200, await reply.text()
            sent = sorted((r for i, r in fake.requests.items() if i > before), key=lambda r: r.id)
            assert len(sent) == len(expected)
            for request, files in zip(sent, expected):
                _check_spans(request, *files)
        # generate-one: a session's continuation sends its images again, over the same tokens
        one = {"request_id": "s1", "prompt": f"![]({data_url(DOG)}) hello",
               "generation_config": {"max_new_tokens": 2}, "stream_response": False}
        assert (await client.post("/api/generate-one", json=one)).status == 200
        first = _last(fake).request
        _check_spans(_last(fake), DOG)
        assert (await client.post("/api/generate-one", json=one)).status == 200
        again = _last(fake).request
        assert again.images == first.images and len(again.input_ids) > len(first.input_ids)
    finally:
        await client.close()


BAD = [
    ("/v1/chat/completions", _chat(b"not an image"), 422, "is not an image"),
    ("/v1/chat/completions", _chat(truncated_png()), 422, "truncated or corrupt"),
    ("/v1/chat/completions", _chat(b""), 422, "is empty (0 bytes)"),
    ("/v1/chat/completions", _chat(CAT, DOG, CAT), 422, "--max-images-per-request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}]}, 422,
     "fetches no image URLs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}, 422,
     "reads no local files"),
    ("/generate", {"inputs": f"![]({data_url(b'GIF89a')})"}, 422, "`inputs` image 0 is not an"),
    ("/generate", {"text": "a", "image_data": "aGVsbG8="}, 400, "is not an image"),
    ("/generate", {"input_ids": [1, 2], "image_data": data_url(CAT)}, 400,
     "goes with `text`"),
    ("/generate", {"text": "<start_of_image><start_of_image>", "image_data": data_url(CAT)},
     400, "holds 2 image markers"),
    ("/generate", {"text": "a", "modalities": ["video"]}, 400, "not video or audio"),
]


async def test_bad_images_are_4xx_and_the_server_keeps_serving(gemma3_dir):
    fake = HealthyFake()
    client = await _client(gemma3_dir, fake, max_images_per_request=2, disable_image_fetch=True)
    try:
        for path, body, status, words in BAD:
            reply = await client.post(path, json=body)
            assert reply.status == status, await reply.text()
            assert words in await reply.text()
            assert not fake.requests, "nothing reached the shard"
        good = await client.post("/v1/chat/completions", json=_chat(CAT))
        assert good.status == 200
    finally:
        await client.close()


async def _documented(client: TestClient, document: dict, path: str, method: str = "get",
                      **kwargs) -> dict:
    """The reply's JSON, checked against the served OpenAPI document's schema for it."""
    reply = await client.request(method, path, **kwargs)
    text = await reply.text()
    answer = SimpleNamespace(status_code=reply.status, headers=reply.headers, text=text,
                             json=lambda: json.loads(text))
    assert answer_problems(document, path, method, answer) == []
    return json.loads(text)


async def test_info_and_models_say_whether_a_model_takes_images(gemma3_dir, tiny_llama):
    for model_dir, takes in ((gemma3_dir, True), (tiny_llama, False)):
        client = await _client(model_dir, HealthyFake())
        try:
            document = await (await client.get("/api-doc/openapi.json")).json()
            info = await _documented(client, document, "/info")
            assert info["takes_images"] is takes
            (model,) = (await _documented(client, document, "/v1/models"))["data"]
            assert model["metadata"]["takes_images"] is takes
            if takes:  # a chat with an image and an SGLang image_data, as documented
                await _documented(client, document, "/v1/chat/completions", "post",
                                  json=_chat(CAT))
                await _documented(client, document, "/generate", "post", json={
                    "text": "a", "image_data": [data_url(CAT)], "modalities": ["image"],
                    "sampling_params": {"max_new_tokens": 2}})
        finally:
            await client.close()


async def test_a_text_only_model_refuses_images_saying_so(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        for path, body in (("/v1/chat/completions", _chat(CAT)),
                           ("/generate", {"text": "a", "image_data": data_url(CAT)})):
            reply = await client.post(path, json=body)
            assert reply.status in (400, 422)
            assert "takes no images, it reads text only" in await reply.text()
        # TGI's markdown is text to a text model, as in TGI
        reply = await client.post("/generate", json={"inputs": "![](http://x/a.png)",
                                                     "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200 and not _last(fake).request.images
    finally:
        await client.close()


def test_the_shard_message_carries_each_image_over_its_span():
    request = GenerateRequest(inputs="", input_ids=[5] * 10, sampling=SamplingParams(),
                              stopping=StoppingParams(max_new_tokens=1),
                              images=[PromptImage(b"png", b"d", 2, 4), PromptImage(b"jpg", b"e",
                                                                                   7, 3)])
    message = request_message(ShardRequest(0, request, blocks=[1]))
    assert [(i.data, i.token_offset, i.token_count) for i in message.images] == [
        (b"png", 2, 4), (b"jpg", 7, 3)]
    assert pb.Request.FromString(message.SerializeToString()).images[1].token_offset == 7


async def test_an_images_tokens_count_against_the_prompt_limit(gemma3_dir):
    fake = HealthyFake()
    client = await _client(gemma3_dir, fake)  # at most 200 prompt tokens
    try:
        async def count(*images, text):
            reply = await client.post("/chat_tokenize", json=_chat(*images, text=text))
            return len((await reply.json())["tokenize_response"])

        words = 1  # the longest text that fits alone
        while await count(text="hello " * (words + 1)) <= 200:
            words += 1
        text = "hello " * words
        assert await count(CAT, text=text) > 200 >= await count(text=text)
        assert (await client.post("/v1/chat/completions", json=_chat(text=text))).status == 200
        reply = await client.post("/v1/chat/completions", json=_chat(CAT, text=text))
        assert reply.status == 422 and "must have less than 200 tokens" in await reply.text()
    finally:
        await client.close()
