"""Bad input and bursts against the real app over a scripted shard: every answer a 4xx or a 429 in
the route's error shape, and the server serving normally afterwards."""
import asyncio
import json

import pytest

from router.api.openapi import openapi_document
from router.inputs.json_text import MAX_DEPTH
from tests.loop_gaps import LoopGaps
from tests.unit.router.test_api_errors import HealthyFake, _body, _client

TGI_ROUTES = ["/generate", "/generate_stream", "/"]


async def _still_serves(client):
    reply = await client.post("/generate", json=_body())
    assert reply.status == 200, await reply.text()


@pytest.mark.parametrize("path", TGI_ROUTES)
@pytest.mark.parametrize("name,value,wire", [
    ("top_k", 12834398069340654, "i32"), ("top_k", 2**31, "i32"),
    ("max_new_tokens", 2**32, "u32"), ("max_new_tokens", -1, "u32"),
    ("top_n_tokens", 2**32, "u32"), ("seed", 2**64, "u64"), ("seed", -5, "u64"),
    ("truncate", 2**64, "u64"), ("best_of", 2**64, "u64")])
async def test_integers_beyond_their_wire_type_are_422(tiny_llama, path, name, value, wire):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = {"inputs": "hi", "parameters": {"do_sample": True, "max_new_tokens": 2, name: value}}
        reply = await client.post(path, json=body)
        assert reply.status == 422
        error = await reply.json()
        assert error["error_type"] == "validation"
        assert f"parameters.{name}: invalid value: integer `{value}`, expected {wire}" in \
            error["error"]
        await _still_serves(client)
    finally:
        await client.close()


def _nested(depth: int) -> bytes:
    return b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("data,expected", [
    (_nested(5000), "recursion limit"),
    (_nested(MAX_DEPTH), "recursion limit"),
    (b'{"inputs": "hi", "parameters": {"temperature": NaN}}', "`NaN` is not a JSON number"),
    (b'{"inputs": "hi", "parameters": {"temperature": Infinity}}', "`Infinity`"),
    (b'{"inputs": "hi", "parameters": {"temperature": -Infinity}}', "`-Infinity`"),
    (b'{"inputs": "hi", "parameters": {"temperature": 1e400}}', "out of range"),
    (b'{"inputs": "hi", "parameters": {"seed": ' + b"9" * 5000 + b"}}", "digits"),
    (b'{"inputs": "hi \\ud800"}', "lone surrogate"),
    (b'{"inputs": "hi", "parameters": {"stop": ["\\udfff"]}}', "lone surrogate"),
])
@pytest.mark.parametrize("path", TGI_ROUTES + ["/v1/chat/completions", "/v1/completions",
                                               "/tokenize"])
async def test_json_that_python_reads_but_json_forbids_is_422(tiny_llama, path, data, expected):
    if path.startswith("/v1") and b"parameters" in data:
        data = data.replace(b'"inputs": "hi", "parameters": {', b'"prompt": "hi", "messages": '
                            b'[{"role": "user", "content": "hi"}], "x": {')
    await _assert_422(tiny_llama, path, data, expected)


@pytest.mark.parametrize("data", [
    b'{"inputs": "hi", "parameters": {"temperature": 1e39}}',
    b'{"inputs": "hi", "parameters": {"temperature": ' + b"9" * 400 + b"}}"])
@pytest.mark.parametrize("path", TGI_ROUTES)
async def test_floats_beyond_float32_are_422(tiny_llama, path, data):
    await _assert_422(tiny_llama, path, data, "expected a finite f32")


async def _assert_422(tiny_llama, path: str, data: bytes, expected: str) -> None:
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post(path, data=data, headers={"Content-Type": "application/json"})
        body = await reply.json()
        assert reply.status == 422, body
        assert body["error_type"] == "validation" and expected in body["error"], body
        await _still_serves(client)
    finally:
        await client.close()


async def test_nesting_up_to_the_limit_parses(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", data=_nested(MAX_DEPTH - 2),
                                  headers={"Content-Type": "application/json"})
        assert reply.status == 422
        assert "inputs: invalid type" in (await reply.json())["error"], "parsed, then typed"
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("seed", -1), ("max_tokens", 2**40), ("max_tokens", 0), ("n", 2**40),
    ("temperature", 2.5), ("top_p", 0), ("frequency_penalty", 3), ("presence_penalty", -3),
    ("stream", "yes"), ("stream_options", "x"), ("stream_options", {"include_usage": 1}),
    ("logprobs", 2**40), ("temperature", 10**400), ("n", 10**400), ("seed", 10**400),
    ("max_tokens", 2**31), ("max_completion_tokens", 0)])
async def test_openai_fields_out_of_bounds_are_422(tiny_llama, path, field, value):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                "max_tokens": 2, field: value}
        if field == "logprobs" and path.endswith("chat/completions"):
            body["logprobs"] = "yes"
        reply = await client.post(path, json=body)
        assert reply.status == 422, await reply.text()
        assert (await reply.json())["error_type"] == "validation"
        if (field, value) == ("max_tokens", 2**31):  # its own bound, not the model's length
            assert str(2**31 - 1) in (await reply.json())["error"]
    finally:
        await client.close()


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "tools": [1]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "f"}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": True, "logprobs": True},
    {"prompt": "hi", "suffix": 5},
    {"prompt": "hi", "echo": "yes"},
])
async def test_openai_bodies_of_the_wrong_shape_are_422(tiny_llama, body):
    client = await _client(tiny_llama, HealthyFake())
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    try:
        reply = await client.post(path, json=body)
        assert reply.status == 422, await reply.text()
    finally:
        await client.close()


async def test_a_burst_of_ten_times_the_limit_gets_only_200_or_429_with_retry_after(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(step_delay=0.002), max_concurrent=4)
    try:
        async def one(i):
            path = "/generate_stream" if i % 2 else "/generate"
            reply = await client.post(path, json=_body(max_new_tokens=5))
            body = await reply.read()
            return reply.status, reply.headers.get("Retry-After"), body

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 60)
        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) > 0 and statuses.count(200) >= 4
        for status, retry_after, body in results:
            if status == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert b'"error_type":"overloaded"' in body.replace(b" ", b"")
        await _still_serves(client)
    finally:
        await client.close()


def test_openapi_declares_each_integers_wire_range_and_each_numbers_format():
    doc = openapi_document()
    params = doc["components"]["schemas"]["GenerateParameters"]["properties"]
    assert params["top_k"]["format"] == "int32" and params["top_k"]["maximum"] == 2**31 - 1
    assert params["max_new_tokens"]["maximum"] == 2**32 - 1
    assert params["seed"]["format"] == "int64" and params["seed"]["maximum"] == 2**64 - 1
    assert params["temperature"]["format"] == "float"
    chat = doc["components"]["schemas"]["ChatRequest"]["properties"]
    assert chat["temperature"]["maximum"] == 2 and chat["seed"]["maximum"] == 2**64 - 1
    assert chat["max_tokens"]["minimum"] == 1 and chat["max_tokens"]["maximum"] == 2**31 - 1
    for schema in (*params.values(), *chat.values()):
        if schema.get("type") == "integer":
            assert {"format", "minimum", "maximum"} <= set(schema), schema


async def test_a_body_its_content_encoding_does_not_decode_is_4xx_in_the_routes_shape(
        tiny_llama, caplog):
    client = await _client(tiny_llama, HealthyFake())
    try:
        for encoding in ("gzip", "deflate"):
            reply = await client.post("/generate", data=b"not compressed",
                                      headers={"Content-Type": "application/json",
                                               "Content-Encoding": encoding})
            body = await reply.json()
            assert reply.status == 422 and body["error_type"] == "validation", body
            assert "Failed to read the request body" in body["error"]
        reply = await client.post("/abort_request", data=b"not compressed",  # SGLang's route
                                  headers={"Content-Encoding": "gzip"})
        body = await reply.json()
        assert reply.status == 400 and "Failed to read" in body["error"]["message"], body
        await _still_serves(client)
        # aiohttp read on into the undecodable rest and logged a traceback for each request
        assert not [r for r in caplog.records if r.name.startswith("aiohttp")
                    and r.levelname == "ERROR"], caplog.text
    finally:
        await client.close()


def _deep_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


@pytest.mark.parametrize("schema", [_deep_schema(900), "[" * 5000 + "]" * 5000],
                         ids=["schema-900-deep", "arrays-5000-deep"])
@pytest.mark.parametrize("route", ["tgi", "sglang", "chat", "chat-tool"])
async def test_a_json_schema_string_nested_too_deep_is_422(tiny_llama, route, schema):
    client = await _client(tiny_llama, HealthyFake())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    path, body = {
        "tgi": ("/generate", {"inputs": "hi", "parameters": {
            "max_new_tokens": 2, "grammar": {"type": "json", "value": schema}}}),
        "sglang": ("/generate", {"text": "hi", "sampling_params": {"json_schema": schema,
                                                                   "max_new_tokens": 2}}),
        "chat": ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        "chat-tool": ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json", "value": schema}}),
    }[route]
    try:
        reply = await client.post(path, json=body)
        error = await reply.json()
        assert reply.status == (400 if route == "sglang" else 422), error  # SGLang's own status
        message = error["error"]["message"] if route == "sglang" else error["error"]
        assert "recursion limit exceeded" in message
        await _still_serves(client)
    finally:
        await client.close()


@pytest.mark.parametrize("body,expected", [
    ({"inputs": "hi", "parameters": {"grammar": {"type": ["json"], "value": {}}}},
     "grammar `type` must be a string"),
    ({"inputs": "hi", "parameters": {"grammar": {"type": {"a": 1}, "value": {}}}},
     "grammar `type` must be a string"),
    ({"inputs": "hi", "parameters": []}, "parameters: invalid type"),
    ({"inputs": "hi", "parameters": ""}, "parameters: invalid type"),
    ({"inputs": "hi", "parameters": False}, "parameters: invalid type"),
    ({"inputs": "hi", "parameters": {"temperature": 1e-46}}, "`temperature` must be strictly"),
    ({"inputs": "hi", "parameters": {"top_p": 1e-46}}, "`top_p` must be > 0.0 and < 1.0"),
    ({"inputs": "hi", "parameters": {"top_p": 0.999999999}}, "`top_p` must be > 0.0 and < 1.0"),
    ({"inputs": "hi", "parameters": {"repetition_penalty": 1e-46}},
     "`repetition_penalty` must be strictly positive"),
])
async def test_tgi_parameters_are_checked_as_the_float32_and_types_tgi_reads(tiny_llama, body,
                                                                              expected):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json=body)
        error = await reply.json()
        assert reply.status == 422 and expected in error["error"], error
    finally:
        await client.close()


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": "x"},
    {"role": "assistant", "content": None, "tool_calls": [5]},
    {"role": "assistant", "content": "hi", "tool_calls": [{"function": "f"}]},
])
async def test_chat_messages_with_malformed_tool_calls_are_422(tiny_llama, message):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}, message], "max_tokens": 2})
        error = await reply.json()
        assert reply.status == 422 and "messages[1].tool_calls must be a list" in error["error"]
    finally:
        await client.close()


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tools,expected", [
    ([_tool("no_tool")], "other than 'no_tool'"),
    ([_tool("")], "must be a non-empty name"),
    ([_tool("f"), _tool("g"), _tool("f")], "tools[2]: a function named 'f' is already offered"),
])
async def test_tools_need_names_of_their_own(tiny_llama, tools, expected):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools,
            "tool_choice": "required"})
        error = await reply.json()
        assert reply.status == 422 and expected in error["error"], error
    finally:
        await client.close()


async def test_sglang_errors_keep_sglangs_shape_even_unforeseen_ones(tiny_llama, monkeypatch):
    from router.api.sglang import routes as sglang

    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json={"input_embeds": [[10**400] * 8],
                                                     "sampling_params": {"max_new_tokens": 2}})
        error = await reply.json()
        assert reply.status == 400 and "must hold finite numbers" in error["error"]["message"]

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(sglang, "parse_generate", broken)
        reply = await client.post("/generate", json={"text": "hi"})
        assert reply.status == 500
        assert await reply.json() == {"error": {"message": "Internal server error",
                                                "type": "internal", "code": 500}}
        reply = await client.post("/generate", json={"inputs": "hi"})  # TGI's keeps TGI's
        assert reply.status == 200
    finally:
        await client.close()


async def _sent_sampling(client, fake, path: str, body: dict):
    """The sampling parameters of the request `body` put on the (fake) shard."""
    fake.requests.clear()
    reply = await client.post(path, json=body)
    assert reply.status == 200, await reply.text()
    (request,) = fake.requests.values()
    return request.request.sampling


async def test_sampling_follows_tgis_warpers_and_a_temperature_rounding_to_0_is_greedy(
        tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        async def tgi(**parameters):
            return await _sent_sampling(client, fake, "/generate", {
                "inputs": "hi", "parameters": {"max_new_tokens": 2, **parameters}})

        assert not (await tgi()).do_sample
        assert not (await tgi(temperature=1.0)).do_sample  # its default warps nothing
        for warper in ({"temperature": 0.5}, {"top_k": 5}, {"top_p": 0.9}, {"typical_p": 0.9}):
            assert (await tgi(**warper)).do_sample, warper
        assert (await tgi(do_sample=True)).do_sample
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # OpenAI: a temperature that float32 rounds to 0 is 0, greedy (not temperature 1)
        sent = await _sent_sampling(client, fake, "/v1/chat/completions",
                                    {**chat, "temperature": 1e-46})
        assert not sent.do_sample
        sent = await _sent_sampling(client, fake, "/generate", {
            "text": "hi", "sampling_params": {"temperature": 1e-46, "max_new_tokens": 2}})
        assert not sent.do_sample  # SGLang's temperature 0 is greedy too
        reply = await client.post("/v1/chat/completions", json={**chat, "top_p": 1e-46})
        assert reply.status == 422 and "`top_p` must be > 0" in (await reply.json())["error"]
    finally:
        await client.close()


_LONG = "#" * 300_000  # megabyte prompts cost the tokeniser seconds


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": _LONG}), ("/generate_stream", {"inputs": _LONG}),
    ("/v1/completions", {"prompt": _LONG}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}),
    ("/generate", {"text": _LONG}),  # SGLang's
    ("/api/generate-one", {"request_id": "s1", "prompt": _LONG})])
async def test_a_prompt_that_cannot_fit_is_refused_before_encoding(tiny_llama, path, body):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post(path, json=body)
        text = await reply.text()
        sglang = path == "/generate" and "text" in body
        assert reply.status == (400 if sglang else 422), text  # SGLang answers 400
        assert "tokens. Given: at least" in text, text
        await _still_serves(client)
    finally:
        await client.close()


async def test_a_long_prompt_with_truncate_or_to_tokenize_is_still_encoded(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json={
            "inputs": _LONG, "parameters": {"truncate": 8, "max_new_tokens": 2}})
        assert reply.status == 200, await reply.text()
        reply = await client.post("/tokenize", json={"inputs": _LONG[:20_000]})
        assert reply.status == 200 and len(await reply.json()) > 64
    finally:
        await client.close()


def _many_tools():
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
            for i in range(5000)]


def _enum(count: int) -> dict:
    return {"enum": [f"v{i}" for i in range(count)]}


# made when the test runs: big bodies held at once make each garbage collection slow
@pytest.mark.parametrize("path,make_body", [
    ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2, "tools": _many_tools()}),
    ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": "a"}] * 55_000,
                                      "max_tokens": 2}),
    ("/generate", lambda: {"inputs": "hi", "parameters": {"max_new_tokens": 2, "grammar": {
        "type": "json", "value": _enum(60_000)}}}),
    ("/generate", lambda: {"text": "hi", "sampling_params": {  # SGLang's
        "max_new_tokens": 2, "json_schema": json.dumps(_enum(60_000))}}),
    ("/v1/completions", lambda: {"prompt": "hi", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _enum(60_000)}}}),
    ("/generate", lambda: {"inputs": "hi", "x": [0] * 600_000})])
async def test_a_slow_body_to_read_does_not_hold_the_event_loop(tiny_llama, path, make_body):
    """Bodies, tools, messages and grammars that take a while to check are read in a worker
    thread, so the loop goes on answering (20,000 tools held it for 18 s)."""
    import gc

    body = make_body()
    gc.collect()
    client = await _client(tiny_llama, HealthyFake())
    try:
        async with LoopGaps() as watch:  # the server runs on this loop: a held handler shows
            reply = await client.post(path, json=body)
        assert reply.status in (200, 422), await reply.text()
        assert watch.took > 0.1, "the body should take a while to read"
        assert watch.longest < watch.took / 2, (watch.longest, watch.took)
    finally:
        await client.close()
