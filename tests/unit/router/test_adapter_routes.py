"""How each API chooses a LoRA adapter, with the real app over a scripted shard: a loaded adapter
reaches the shard's request as its adapter_id, one not loaded is the API's own 4xx in the API's
own body, and none (or "") is the base model.

The fake shard takes any adapter load, as shards that read the files would (and refuses a request
naming one it has not loaded); the registry still checks the directory, so each test loads from a
directory holding PEFT's two file names.
"""
import json
import socket

import grpc
import pytest

from proto import api_pb2 as api
from proto import api_pb2_grpc
from router.state import STATE
from tests.unit.router.test_api_errors import HealthyFake, _client

NOT_LOADED = "adapter 'nope' is not loaded; the loaded adapters are: sql"


class AdapterShards(HealthyFake):
    def adapters_seen(self) -> list[str | None]:
        """The adapter_id of every request the shard was given, in order."""
        return [r.request.adapter_id for r in self.requests.values()]


@pytest.fixture
def adapter_dir(tmp_path):
    directory = tmp_path / "sql-lora"
    directory.mkdir()
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return directory


async def _served_with_adapter(tiny_llama, adapter_dir, **options):
    """(client, shard): the app over scripted shards, adapter `sql` loaded from adapter_dir."""
    shard = AdapterShards()
    client = await _client(tiny_llama, shard, **options)
    served = client.server.app[STATE].models.default
    await served.adapters.load("sql", str(adapter_dir))
    return client, shard


async def test_tgi_adapter_id_picks_the_adapter_and_refuses_one_not_loaded(tiny_llama,
                                                                          adapter_dir):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)
    try:
        for route, adapter in (("/generate", "sql"), ("/generate_stream", "sql"), ("/", "sql"),
                               ("/generate", None), ("/generate", ""), ("/", None)):
            params = {"max_new_tokens": 2} if adapter is None else \
                {"max_new_tokens": 2, "adapter_id": adapter}
            reply = await client.post(route, json={"inputs": "hello", "parameters": params})
            assert reply.status == 200, await reply.text()
            await reply.read()
        assert shard.adapters_seen() == ["sql", "sql", "sql", None, None, None]
        for route in ("/generate", "/generate_stream", "/"):
            reply = await client.post(route, json={"inputs": "hello",
                                                   "parameters": {"adapter_id": "nope"}})
            assert reply.status == 422
            assert await reply.json() == {"error": f"Input validation error: {NOT_LOADED}",
                                          "error_type": "validation"}
        assert len(shard.requests) == 6, "a refused request never reaches the shard"
    finally:
        await client.close()


async def test_openai_model_naming_an_adapter_runs_it_and_answers_its_name(tiny_llama,
                                                                          adapter_dir):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)
    try:
        state = client.server.app[STATE]
        base = state.models.default.model_name
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = await client.post("/v1/chat/completions", json={**chat, "model": "sql"})
        assert reply.status == 200 and (await reply.json())["model"] == "sql"
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "model": "sql", "stream": True})
        frames = [json.loads(line[len("data: "):]) for line in (await reply.text()).splitlines()
                  if line.startswith("data: {")]
        assert frames and all(frame["model"] == "sql" for frame in frames)
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "model": base})
        assert (await reply.json())["model"] == base
        assert shard.adapters_seen() == ["sql", "sql", None]
        # one model serving adapters: "tgi" is still the model, a name neither it nor an adapter
        # has is a mistyped adapter's (404), not the base model's answer
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "model": "tgi"})
        assert reply.status == 200 and shard.adapters_seen()[-1] is None
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "model": "sql-typo"})
        assert reply.status == 404 and "LoRA adapters (sql)" in (await reply.json())["error"]
        # once several models run, a name that is neither a model nor an adapter is a 404
        state.models.served["org/second"] = state.models.default
        for route, body in (("/v1/chat/completions", chat),
                            ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
            reply = await client.post(route, json={**body, "model": "nope"})
            assert reply.status == 404
            error = await reply.json()  # TGI's body, as TGI's OpenAI routes answer
            assert error["error_type"] == "model_not_found" and "'nope' not found" in error["error"]
            reply = await client.post(route, json={**body, "model": "sql"})
            assert reply.status == 200, "an adapter stays a model with several running"
        assert len(shard.requests) == 6
    finally:
        await client.close()


async def test_openai_model_naming_an_adapter_being_unloaded_is_404(tiny_llama, adapter_dir):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)
    try:
        # closed to new requests, as during an unload, while the registry still lists it
        client.server.app[STATE].models.default.adapters.use.close("sql")
        reply = await client.post("/v1/completions", json={"prompt": "hi", "model": "sql"})
        assert reply.status == 404
        assert (await reply.json())["error_type"] == "model_not_found"
        assert not shard.requests
    finally:
        await client.close()


async def test_sglang_lora_path_takes_a_name_a_directory_or_one_per_prompt(tiny_llama,
                                                                           adapter_dir):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)
    try:
        sampling = {"max_new_tokens": 2}
        for body in ({"text": "a", "lora_path": "sql"},
                     {"text": "a", "lora_path": str(adapter_dir)},
                     {"text": "a", "lora_id": "sql"},
                     {"text": "a", "lora_path": "sql", "lora_id": "sql"},
                     {"text": "a", "lora_path": None},
                     {"text": ["a", "b", "c"], "lora_path": ["sql", None, ""]},
                     {"input_ids": [[1, 2], [3]], "lora_path": "sql"}):
            reply = await client.post("/generate", json={**body, "sampling_params": sampling})
            assert reply.status == 200, await reply.text()
        assert shard.adapters_seen() == ["sql", "sql", "sql", "sql", None, "sql", None, None,
                                         "sql", "sql"]
        served = client.server.app[STATE].models.default
        await served.adapters.load("chat", str(adapter_dir))
        reply = await client.post("/generate", json={"text": ["a", "b"], "lora_path": "sql",
                                                     "lora_id": ["sql", "chat"]})
        assert reply.status == 400
        assert "name different adapters for prompt 1" in (await reply.json())["error"]["message"]
        assert len(shard.requests) == 10
    finally:
        await client.close()


@pytest.mark.parametrize("fields,message", [
    ({"text": "a", "lora_path": "nope"}, f"`lora_path`: {NOT_LOADED}"),
    ({"text": "a", "lora_path": "/no/such/dir"}, "adapter '/no/such/dir' is not loaded"),
    ({"text": "a", "lora_id": "nope"}, f"`lora_id`: {NOT_LOADED}"),
    ({"text": ["a", "b"], "lora_path": ["sql", "nope"]}, NOT_LOADED),
    ({"text": ["a", "b"], "lora_path": ["sql"]}, "`lora_path` holds 1 values for 2 prompts"),
    ({"text": "a", "lora_path": 3}, "`lora_path` must be a string"),
    ({"text": "a", "lora_path": "sql", "lora_id": "base"}, "`lora_id`: adapter 'base'"),
])
async def test_sglang_adapter_not_loaded_is_a_400_in_sglangs_body(tiny_llama, adapter_dir,
                                                                   fields, message):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)
    try:
        reply = await client.post("/generate", json=fields)
        assert reply.status == 400
        error = (await reply.json())["error"]
        assert error["code"] == 400 and message in error["message"], error
        assert not shard.requests
    finally:
        await client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_grpc_adapter_id_picks_the_adapter_and_refuses_one_not_loaded(tiny_llama,
                                                                           adapter_dir):
    port = _free_port()
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir, grpc_port=port,
                                               hostname="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_pb2_grpc.TextGenerationStub(channel)

            def request(**params):
                return api.GenerateRequest(inputs="hello", parameters=api.GenerateParameters(
                    max_new_tokens=2, **params))

            await stub.Generate(request(adapter_id="sql"))
            [m async for m in stub.GenerateStream(request(adapter_id="sql"))]
            await stub.Generate(request())
            await stub.Generate(request(adapter_id=""))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(request(adapter_id="nope"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"Input validation error: {NOT_LOADED}"
        assert shard.adapters_seen() == ["sql", "sql", None, None]
    finally:
        await client.close()


async def test_generate_one_session_keeps_the_adapter_it_started_with(tiny_llama, adapter_dir):
    client, shard = await _served_with_adapter(tiny_llama, adapter_dir)

    async def call(request_id: str, **config):
        return await client.post("/api/generate-one", json={
            "request_id": request_id, "prompt": "hello", "stream_response": False,
            "generation_config": {"max_new_tokens": 2, **config}})

    try:
        assert (await call("s1", adapter_id="sql")).status == 200
        assert (await call("s1")).status == 200, "left out: the session's adapter"
        assert (await call("s1", adapter_id="sql")).status == 200
        assert (await call("s2")).status == 200
        assert (await call("s3", adapter_id="")).status == 200
        assert shard.adapters_seen() == ["sql", "sql", "sql", None, None]
        for request_id, adapter, words in (
                ("s1", "", "was started with adapter 'sql'"),
                ("s2", "sql", "was started with the base model"),
                ("s4", "nope", NOT_LOADED)):
            reply = await call(request_id, adapter_id=adapter)
            assert reply.status == 422
            body = await reply.json()
            assert body["error_type"] == "validation" and words in body["error"], body
        reply = await client.post("/api/generate-batch", json={
            "prompts": [{"request_id": "s1", "prompt": "x"}, {"request_id": "b1", "prompt": "y"}],
            "generation_config": {"max_new_tokens": 2, "adapter_id": "sql"}})
        assert reply.status == 200, await reply.text()
        assert shard.adapters_seen()[5:] == ["sql", "sql"]
        reply = await call("s5", adapter_id=3)
        assert reply.status == 422 and "adapter_id` must be a string" in (await reply.json())[
            "error"]
    finally:
        await client.close()
