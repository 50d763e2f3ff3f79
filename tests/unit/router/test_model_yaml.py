"""A Cortex model.yml's flat fields on PATCH: each moved to its group, checked and applied."""
import pytest

from router.errors import ValidationError
from router.lifecycle.model_yaml import model_yaml_body
from router.lifecycle.registry import STOPPED, ModelRecord
from router.lifecycle.settings import ChatPrompt
from router.state import STATE
from tests.unit.router.test_api_errors import HealthyFake, _client

CURRENT = {"id": "m", "object": "model", "created": 5, "owned_by": "tgi-py", "assets": ["/d"]}


def test_flat_fields_move_into_their_groups():
    body = model_yaml_body({"ctx_len": 2048, "ngl": 0, "cpu_threads": 4, "max_tokens": 64,
                            "stop": ["</s>"], "temperature": 0.6, "frequency_penalty": 0.5,
                            "presence_penalty": -0.5, "prompt_template": "{prompt}",
                            "engine": "cortex.llamacpp", "version": "1", "model": "m",
                            "id": "m", "object": "model", "name": "M",
                            "settings": {"n_parallel": 2}}, CURRENT)
    assert body == {"name": "M",
                    "settings": {"n_parallel": 2, "ctx_len": 2048, "ngl": 0, "cpu_threads": 4},
                    "parameters": {"token_limit": 64, "stop": ["</s>"], "temperature": 0.6,
                                   "frequency_penalty": 0.5, "presence_penalty": -0.5},
                    "engine_parameters": {"prompt_template": "{prompt}"}}


def test_a_whole_file_sent_back_unchanged_is_accepted():
    assert model_yaml_body({**CURRENT, "settings": None, "ctx_len": 64}, CURRENT) == \
        {"settings": {"ctx_len": 64}}


@pytest.mark.parametrize("body, words", [
    ({"engine": "onnxruntime"}, "its own engine"), ({"engine": 3}, "its own engine"),
    ({"model": "other"}, "`model` cannot be changed"), ({"created": 6}, "`created` cannot"),
    ({"files": ["/x.gguf"]}, "`files` cannot"), ({"version": 2}, "`version` must be 1"),
    ({"model_type": "rerank"}, "llm or embedding"), ({"settings": 5, "ngl": 1}, "object"),
])
def test_what_cannot_apply_is_refused_with_its_reason(body, words):
    with pytest.raises(ValidationError, match=words):
        model_yaml_body(body, CURRENT)


def test_cortex_model_type_embedding_is_jans_embedding_setting():
    assert model_yaml_body({"model_type": "embedding", "ctx_len": 64}, CURRENT) == \
        {"settings": {"ctx_len": 64, "embedding": True}}


def test_a_prompt_template_splits_as_cortex_splits_it():
    prompt = ChatPrompt.of({"prompt_template": "<|system|>\n{system_message}<|user|>\n{prompt}"
                                               "<|assistant|>"})
    assert prompt.render([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"}]) == \
        "<|system|>\nBe brief.<|user|>\nHi<|assistant|>"
    no_system = ChatPrompt.of({"prompt_template": "<start_of_turn>user\n{prompt}<end_of_turn>\n"
                                                  "<start_of_turn>model"})
    assert no_system.render([{"role": "user", "content": "Hi"}]) == \
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model"


async def test_a_running_models_stop_and_penalties_are_its_request_defaults(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("served", "running", model_dir=str(tiny_llama)))
        manager.served["served"] = manager.default
        reply = await client.patch("/v1/models/served", json={
            "stop": "t2", "max_tokens": 5, "presence_penalty": 1.5, "model": "served"})
        assert reply.status == 200, await reply.text()
        assert manager.default.request_defaults == {"stop": ["t2"], "token_limit": 5,
                                                    "presence_penalty": 1.5}
        chat = await (await client.post("/v1/chat/completions", json={
            "model": "served", "messages": [{"role": "user", "content": "hi"}]})).json()
        choice = chat["choices"][0]
        assert choice["finish_reason"] == "stop" and "t2" not in choice["message"]["content"]
        bad = await client.patch("/v1/models/served", json={"engine": "tensorrt-llm"})
        assert bad.status == 422 and "its own engine" in (await bad.json())["error"]
    finally:
        await client.close()


async def test_cortexs_start_body_keeps_a_model_ymls_fields(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("other", STOPPED, model_dir="/nowhere"))
        start = await client.post("/v1/models/start", json={
            "model": "other", "ctx_len": 64, "cpu_threads": 2, "engine": "llama-cpp",
            "prompt_template": "U: {prompt}\nA: ", "stop": ["</s>"]})
        assert start.status == 503, "without tgi-launcher nothing starts; the fields are kept"
        record = manager.registry.get("other")
        assert record.settings == {"ctx_len": 64, "cpu_threads": 2}
        assert record.engine_parameters == {"prompt_template": "U: {prompt}\nA: "}
        assert record.parameters == {"stop": ["</s>"]}
    finally:
        await client.close()
