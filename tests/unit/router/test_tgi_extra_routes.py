"""TGI's /chat_tokenize, /invocations, and /tokenize's truncate (the scripted shard's tokens are
"t1 ", "t2 ", ...)."""
import pytest

from tests.unit.router.test_api_errors import HealthyFake, _client


async def test_tokenize_keeps_the_last_tokens_when_truncating(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        whole = await (await client.post("/tokenize", json={"inputs": "hello there world"})).json()
        assert len(whole) > 2
        cut = await (await client.post("/tokenize", json={
            "inputs": "hello there world", "parameters": {"truncate": 2}})).json()
        assert cut == whole[-2:]
        reply = await client.post("/tokenize", json={"inputs": "hi", "parameters": {
            "truncate": "two"}})
        assert reply.status == 422
    finally:
        await client.close()


async def test_chat_tokenize_renders_the_template_and_tokenizes_its_text(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/chat_tokenize", json={
            "messages": [{"role": "user", "content": "hello there"}]})
        body = await reply.json()
        assert reply.status == 200, body
        text = body["templated_text"]
        assert "hello there" in text
        tokens = body["tokenize_response"]
        assert "".join(t["text"] for t in tokens) == text[tokens[0]["start"]:tokens[-1]["stop"]]
        assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)
        reply = await client.post("/chat_tokenize", json={"messages": []})
        assert reply.status == 422
    finally:
        await client.close()


@pytest.mark.parametrize("body,check", [
    ({"inputs": "hi", "parameters": {"max_new_tokens": 2}},
     lambda out: out == [{"generated_text": "hit1 t2 "}]),  # POST /: the full text
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     lambda out: out["object"] == "chat.completion"
     and out["choices"][0]["message"]["content"] == "t1 t2 "),
    ({"prompt": "hi", "max_tokens": 2},
     lambda out: out["object"] == "text_completion" and out["choices"][0]["text"] == "t1 t2 "),
])
async def test_invocations_serves_the_route_the_body_names(tiny_llama, body, check):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/invocations", json=body)
        out = await reply.json()
        assert reply.status == 200 and check(out), out
    finally:
        await client.close()


async def test_invocations_streams_and_refuses_a_body_of_no_route(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/invocations", json={"inputs": "hi", "stream": True,
                                                        "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200 and reply.content_type == "text/event-stream"
        assert "data:" in await reply.text()
        reply = await client.post("/invocations", json={"text": "hi"})
        error = await reply.json()
        assert reply.status == 422 and "SagemakerRequest" in error["error"]
    finally:
        await client.close()
