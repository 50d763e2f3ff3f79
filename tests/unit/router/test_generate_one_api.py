"""/api/generate-one and /api/generate-batch over a scripted shard: plain-text answers, server
defaults, and request_id sessions that continue from the blocks they kept."""
import asyncio

from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.waiting import wait_until_async


def _one(request_id="s1", prompt="hello", **fields):
    return {"request_id": request_id, "prompt": prompt, **fields}


async def test_one_answers_plain_text_streamed_or_not(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/api/generate-one", json=_one(
            stream_response=False, generation_config={"max_new_tokens": 3}))
        assert reply.status == 200 and reply.content_type == "text/plain"
        assert await reply.text() == "t1 t2 t3 "
        reply = await client.post("/api/generate-one", json=_one(
            "s2", generation_config={"max_new_tokens": 2}))
        assert reply.status == 200 and reply.content_type == "text/plain"
        assert reply.headers.get("Transfer-Encoding") == "chunked"
        assert await reply.text() == "t1 t2 "
    finally:
        await client.close()


async def test_a_known_id_continues_from_its_blocks_and_ignores_its_prompt(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        config = {"max_new_tokens": 3}
        first = await client.post("/api/generate-one", json=_one(
            stream_response=False, generation_config=config))
        assert await first.text() == "t1 t2 t3 "
        prompt_ids = next(iter(fake.requests.values())).request.input_ids
        again = await client.post("/api/generate-one", json=_one(
            prompt="something else entirely", stream_response=False, only_new_tokens=False,
            generation_config=config))
        assert await again.text() == "hello" + "t1 t2 t3 " * 2
        continuation = list(fake.requests.values())[-1]
        history = prompt_ids + [1, 2, 3]
        assert continuation.request.input_ids == history
        # every token but the last generated one comes from the session's blocks
        assert continuation.cache_len == len(history) - 1
        third = await client.post("/api/generate-one", json=_one(
            only_new_tokens=False, generation_config=config))
        assert await third.text() == "hello" + "t1 t2 t3 " * 3
        metrics = await (await client.get("/metrics")).text()
        assert "tgi_sessions 1.0" in metrics
    finally:
        await client.close()


async def test_batch_keeps_order_and_gives_prompts_when_asked(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = {"prompts": [{"request_id": "b", "prompt": "x y"}, {"request_id": "a",
                                                                     "prompt": "z"}],
                "generation_config": {"max_new_tokens": 2}}
        reply = await client.post("/api/generate-batch", json=body)
        assert reply.status == 200
        assert await reply.json() == [{"request_id": "b", "response": "t1 t2 "},
                                      {"request_id": "a", "response": "t1 t2 "}]
        # continued, in the other order: each id its own history
        body["prompts"].reverse()
        body["only_new_tokens"] = False
        reply = await client.post("/api/generate-batch", json=body)
        assert await reply.json() == [
            {"request_id": "a", "prompt": "z", "response": "t1 t2 t1 t2 "},
            {"request_id": "b", "prompt": "x y", "response": "t1 t2 t1 t2 "}]
    finally:
        await client.close()


async def test_missing_fields_come_from_the_server_defaults(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), default_max_new_tokens=4,
                           default_do_sample="true", default_temperature=0.5)
    try:
        reply = await client.post("/api/generate-one", json=_one(stream_response=False))
        assert await reply.text() == "t1 t2 t3 t4 "
        info = await (await client.get("/info")).json()
        assert info["generation_defaults"]["max_new_tokens"] == 4
        assert info["generation_defaults"]["do_sample"] is True
        assert info["generation_defaults"]["temperature"] == 0.5
        assert info["session_ttl"] == 600.0
    finally:
        await client.close()


async def test_a_second_call_on_a_running_id_is_a_409_and_bad_bodies_are_4xx(
        tiny_llama):
    fake = HealthyFake(step_delay=0.02)
    client = await _client(tiny_llama, fake)
    try:
        running = asyncio.ensure_future(client.post("/api/generate-one", json=_one(
            stream_response=False, generation_config={"max_new_tokens": 20})))
        await wait_until_async(lambda: fake.generated, "the first call to be running")
        busy = await client.post("/api/generate-one", json=_one(stream_response=False))
        assert busy.status == 409 and "still running" in (await busy.json())["error"]
        assert (await running).status == 200
        for body, words in (
                ({"prompt": "a"}, "`request_id` is required"),
                ({"request_id": "x"}, "`prompt` is required"),
                ({"request_id": 5, "prompt": "a"}, "`request_id` is required"),
                (_one(stream_response="yes"), "`stream_response` must be a boolean"),
                (_one(what=1), "`what` is not a field"),
                (_one(generation_config={"temperature": 0}), "temperature` must be > 0"),
                (_one(generation_config={"top_p": 2}), "top_p` must be"),
                (_one(generation_config={"top_k": -1}), "top_k` must be"),
                (_one(generation_config={"max_new_tokens": 0}), "max_new_tokens` must be"),
                (_one(generation_config={"max_new_tokens": 1000}), "must be <= 128"),
                (_one(generation_config={"num_beams": 17}), "num_beams` must be <= 16"),
                (_one(generation_config={"length_penalty": 1000}), "length_penalty` must be"),
                (_one(generation_config={"num_beams": 2, "repetition_penalty": 1.2}),
                 "repetition_penalty` other than 1"),
                (_one(generation_config={"do_sample": 1}), "do_sample` must be a boolean"),
                (_one(generation_config={"beams": 1}), "`beams` is not a field"),
                (_one(generation_config=[]), "must be an object"),
                (_one("fresh", prompt=""), "cannot be empty")):
            reply = await client.post("/api/generate-one", json=body)
            assert reply.status == 422, (body, await reply.text())
            error = await reply.json()
            assert words in error["error"] and error["error_type"] == "validation", error
        for body, words in (({}, "`prompts` is required"), ({"prompts": []}, "`prompts` is"),
                            ({"prompts": ["a"]}, "`prompts[0]` must be an object"),
                            ({"prompts": [{"request_id": "a"}]}, "`prompts[0].prompt`"),
                            ({"prompts": [_one("a"), _one("a")]}, "request_id twice")):
            reply = await client.post("/api/generate-batch", json=body)
            assert reply.status == 422 and words in (await reply.json())["error"], body
    finally:
        await client.close()


def test_out_of_range_server_defaults_stop_the_router_at_start():
    import pytest

    from router.config.model import ModelSettings

    for options, words in (({"default_temperature": 0.0}, "temperature"),
                           ({"default_num_beams": 0}, "num_beams"),
                           ({"default_do_sample": "yes"}, "true or false"),
                           ({"session_kv_share": 2.0}, "--session-kv-share")):
        with pytest.raises(ValueError, match=words):
            ModelSettings(tokenizer_path="/m", **options)


async def test_a_batch_is_bounded_by_max_client_batch_size(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), max_client_batch_size=2)
    try:
        body = {"prompts": [_one(f"id{i}") for i in range(3)]}
        reply = await client.post("/api/generate-batch", json=body)
        assert reply.status == 422 and "maximum allowed batch size of 2" in (
            await reply.json())["error"]
    finally:
        await client.close()


async def test_a_request_id_longer_than_the_limit_is_422(tiny_llama):
    from router.api.generate_one.request import MAX_REQUEST_ID

    client = await _client(tiny_llama, HealthyFake())
    try:
        for path, body in [("/api/generate-one", _one(request_id="x" * (MAX_REQUEST_ID + 1))),
                           ("/api/generate-batch", {"prompts": [
                               {"request_id": "ok", "prompt": "hi"},
                               {"request_id": "y" * 100_000, "prompt": "hi"}]})]:
            reply = await client.post(path, json=body)
            text = await reply.text()
            assert reply.status == 422 and f"at most {MAX_REQUEST_ID} characters" in text, text
            assert "y" * 2000 not in text and "x" * 2000 not in text  # the id is not echoed
        reply = await client.post("/api/generate-one", json=_one(
            request_id="z" * MAX_REQUEST_ID, generation_config={"max_new_tokens": 2}))
        assert reply.status == 200, await reply.text()
    finally:
        await client.close()


async def test_a_session_grown_past_the_input_limit_says_so(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())  # 64 input tokens, 128 in all
    try:
        first = await client.post("/api/generate-one", json=_one(
            request_id="long", stream_response=False, generation_config={"max_new_tokens": 100}))
        assert first.status == 200, await first.text()
        again = await client.post("/api/generate-one", json=_one(
            request_id="long", stream_response=False, generation_config={"max_new_tokens": 2}))
        text = await again.text()
        assert again.status == 422 and "request_id 'long' holds" in text, text
        assert "cannot be continued" in text and "new request_id" in text
    finally:
        await client.close()
