"""Bad input and bursts against the real app over a scripted shard: every answer a 4xx or a 429 in
the route's error shape, and the server serving normally afterwards."""
import asyncio

import pytest

from router.json_body import MAX_DEPTH
from router.openapi import openapi_document
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
