"""Errors an OpenAI SDK can read: the real `openai` client against the real app over a scripted
shard gets OpenAI's error object on the /v1 routes, so its exceptions say why; a client without
the SDK's x-stainless-* headers keeps TGI's {error, error_type}."""
import jsonschema
import openai
import pytest

from router.api.openapi import openapi_document
from tests.openapi_schemas import _to_json_schema
from tests.unit.router.test_api_errors import HealthyFake, _client

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OPENAI_FIELDS = {"message", "type", "param", "code"}


def _declared_error(path: str, method: str, status: int) -> dict:
    """Our OpenAPI document's schema of that route's error answer, as a JSON Schema."""
    doc = openapi_document()
    answer = doc["paths"][path][method]["responses"][str(status)]
    return {"components": _to_json_schema(doc["components"]),
            **answer["content"]["application/json"]["schema"]}


def _sdk(client, api_key="unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=api_key,
                              max_retries=0, timeout=30)


@pytest.mark.parametrize("change,param,said", [
    ({"temperature": -1}, "temperature", "`temperature` must be >= 0 and <= 2"),
    ({"top_p": 0}, "top_p", "`top_p` must be > 0"),
    ({"max_tokens": 10**6}, "max_tokens", "must be <= 128"),  # the model's length: 128 tokens
    ({"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens",
     "`max_completion_tokens` must be >= 1"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, "messages",
     "must have less than 64 tokens"),
    ({"stop": 5}, "stop", "`stop` must be a string or a list of strings"),
])
async def test_the_sdk_exception_says_why_and_names_the_field(tiny_llama, change, param, said):
    client = await _client(tiny_llama, HealthyFake())
    try:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await _sdk(client).chat.completions.create(**{**CHAT, **change})
        assert said in str(caught.value)
        assert caught.value.body.keys() == OPENAI_FIELDS
        assert caught.value.body["message"] in str(caught.value)
        assert (caught.value.type, caught.value.param, caught.value.code) == (
            "invalid_request_error", param, "validation")
    finally:
        await client.close()


async def test_a_prompt_too_long_for_completions_is_about_the_prompt(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await _sdk(client).completions.create(model="tiny", prompt="hi " * 200, max_tokens=2)
        assert caught.value.param == "prompt" and "less than 64 tokens" in str(caught.value)
    finally:
        await client.close()


async def test_other_clients_keep_tgi_shape_on_the_same_routes(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        declared = _declared_error("/v1/chat/completions", "post", 422)
        plain = await client.post("/v1/chat/completions", json={**CHAT, "temperature": -1})
        assert plain.status == 422
        assert (await plain.json()).keys() == {"error", "error_type"}
        jsonschema.validate(await plain.json(), declared)
        sdk = await client.post("/v1/chat/completions", json={**CHAT, "temperature": -1},
                                headers={"X-Stainless-Lang": "js"})
        assert (await sdk.json())["error"].keys() == OPENAI_FIELDS, "any Stainless SDK"
        jsonschema.validate(await sdk.json(), declared)
        # TGI's own routes answer in TGI's shape whoever asks
        tgi = await client.post("/generate", json={"inputs": ""},
                                headers={"X-Stainless-Lang": "python"})
        assert (await tgi.json()).keys() == {"error", "error_type"}
        # the model routes' body (a 409's `state`) stays theirs for other clients
        missing = await client.get("/v1/models/no-such-model")
        assert missing.status == 404 and (await missing.json())["error_type"] == "model_not_found"
    finally:
        await client.close()


async def test_models_and_unknown_routes_answer_the_sdk_in_openai_shape(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        sdk = _sdk(client)
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.models.retrieve("no-such-model")
        assert "no-such-model" in str(caught.value) and caught.value.code == "model_not_found"
        assert caught.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.files.list()  # a route this server lacks
        assert caught.value.body.keys() == OPENAI_FIELDS and caught.value.code == "http"
    finally:
        await client.close()


async def test_a_wrong_api_key_reads_why_through_the_sdk(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            await _sdk(client, api_key="nope").chat.completions.create(**CHAT)
        assert "Authorization: Bearer <key>" in str(caught.value)
        assert (caught.value.type, caught.value.code) == ("authentication_error", "authentication")
        with pytest.raises(openai.AuthenticationError):
            await _sdk(client, api_key="nope").models.list()
        plain = await client.post("/v1/chat/completions", json=CHAT)
        assert plain.status == 401 and (await plain.json())["error_type"] == "authentication"
        reply = await _sdk(client, api_key="s3cret").chat.completions.create(**CHAT)
        assert reply.choices[0].finish_reason == "length"
    finally:
        await client.close()


async def test_a_payload_over_the_limit_reads_why_through_the_sdk(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), payload_limit=1000)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            await _sdk(client).completions.create(model="tiny", prompt="x" * 2000, max_tokens=2)
        assert caught.value.status_code == 413 and "Payload too large" in str(caught.value)
        assert caught.value.code == "payload_limit"
    finally:
        await client.close()


async def test_an_error_in_an_open_stream_raises_its_message_in_the_sdk(tiny_llama):
    fake = HealthyFake(step_delay=0.01)
    client = await _client(tiny_llama, fake)
    try:
        stream = await _sdk(client).chat.completions.create(**{**CHAT, "max_tokens": 20},
                                                            stream=True)
        chunks = aiter(stream)
        await anext(chunks)
        fake.fail_next = "decode"
        with pytest.raises(openai.APIError, match="injected decode failure"):
            async for _ in chunks:
                pass
    finally:
        await client.close()
