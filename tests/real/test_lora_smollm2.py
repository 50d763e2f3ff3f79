"""LoRA adapters on SmolLM2-135M through the real processes: two adapters made with peft given to
`--lora-adapters`, a third loaded at run time; every request's greedy text is transformers + peft's
on the same adapter, alone or in a batch that mixes the base model and the adapters."""
import concurrent.futures
import json

import pytest
import requests
from tokenizers import Tokenizer

from tests.e2e.server import free_port, launch
from tests.lora_adapters import ATTENTION, build_adapter, generate_reference, reference_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are"]
NEW_TOKENS = 12
pytestmark = pytest.mark.timeout(900)  # four references and a server of the 135M model


@pytest.fixture(scope="module")
def adapters(real_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-lora")
    return {"one": build_adapter(real_model_dir, root / "one", rank=8, alpha=16, seed=1,
                                 std=0.04),
            "two": build_adapter(real_model_dir, root / "two", rank=16, alpha=16, seed=2,
                                 std=0.04, targets=ATTENTION),
            "three": build_adapter(real_model_dir, root / "three", rank=4, alpha=8, seed=3,
                                   std=0.03, rslora=True)}


@pytest.fixture(scope="module")
def expected(real_model_dir, adapters):
    """(adapter or None, prompt) -> transformers + peft's greedy ids."""
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    out = {}
    for name in (None, "one", "two", "three"):
        model = reference_model(real_model_dir, adapters[name] if name else None)
        for prompt in PROMPTS:
            out[name, prompt] = generate_reference(model, tokenizer.encode(prompt).ids, NEW_TOKENS)
    return out


@pytest.fixture(scope="module")
def server(real_model_dir, adapters, tmp_path_factory):
    grpc_port = free_port()
    launched = launch(["--model-id", str(real_model_dir), "--dtype", "float32"],
                      tmp_path_factory.mktemp("lora-server"),
                      extra=["--lora-adapters",
                             f"one={adapters['one']},two={adapters['two']}",
                             "--grpc-port", str(grpc_port), "--max-batch-prefill-tokens", "512",
                             "--max-total-tokens", "512", "--max-input-tokens", "256",
                             # the adapters loaded at run time lie under it
                             "--allowed-local-model-path", str(tmp_path_factory.getbasetemp())],
                      timeout=600)
    launched.grpc_target = f"127.0.0.1:{grpc_port}"
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


def _generate(server, prompt, adapter=None):
    parameters = {"max_new_tokens": NEW_TOKENS, "decoder_input_details": False, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    reply = requests.post(f"{server.url}/generate", timeout=300,
                          json={"inputs": prompt, "parameters": parameters})
    assert reply.status_code == 200, reply.text
    return [token["id"] for token in reply.json()["details"]["tokens"]]


def test_each_request_alone_and_in_a_mixed_batch_equals_peft(server, expected):
    choices = [(prompt, adapter) for prompt in PROMPTS for adapter in (None, "one", "two")]
    for prompt, adapter in choices[:3]:
        assert _generate(server, prompt, adapter) == expected[adapter, prompt]
    with concurrent.futures.ThreadPoolExecutor(len(choices)) as pool:
        together = list(pool.map(lambda c: _generate(server, *c), choices))
    for (prompt, adapter), ids in zip(choices, together):
        assert ids == expected[adapter, prompt], (prompt, adapter)
    # the adapters change the text: otherwise equal texts would prove nothing
    for adapter in ("one", "two"):
        assert sum(expected[adapter, p] != expected[None, p] for p in PROMPTS) >= 2, adapter


def test_models_list_and_info_name_the_adapters(server, real_model_dir):
    listed = {m["id"]: m for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    base = requests.get(f"{server.url}/info", timeout=10).json()
    assert listed["one"]["parent"] == base["model_id"] and listed["two"]["parent"] == base["model_id"]
    assert {a["name"] for a in base["lora_adapters"]} >= {"one", "two"}
    document = json.dumps(requests.get(f"{server.url}/api-doc/openapi.json", timeout=10).json())
    for field in ('"adapter_id"', '"lora_path"', '"lora_adapters"', "/v1/load_lora_adapter"):
        assert field in document


def test_every_api_chooses_the_adapter(server, expected, real_model_dir, adapters):
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompt = PROMPTS[0]
    text = tokenizer.decode(expected["one", prompt])
    completion = requests.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": "one", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}).json()
    assert completion["model"] == "one" and completion["choices"][0]["text"] == text
    sglang = requests.post(f"{server.url}/generate", timeout=120, json={
        "text": [prompt, prompt], "lora_path": ["one", str(adapters["two"])],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}).json()
    assert sglang[0]["text"] == text
    assert sglang[1]["text"] == tokenizer.decode(expected["two", prompt])
    one = requests.post(f"{server.url}/api/generate-one", timeout=120, json={
        "request_id": "lora", "prompt": prompt, "stream_response": False,
        "generation_config": {"max_new_tokens": NEW_TOKENS, "adapter_id": "two",
                              "do_sample": False}})
    assert one.status_code == 200, one.text
    assert one.text == tokenizer.decode(expected["two", prompt])
    import grpc

    from proto import api_pb2, api_pb2_grpc
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = api_pb2_grpc.TextGenerationStub(channel)
        reply = stub.Generate(api_pb2.GenerateRequest(
            inputs=prompt, parameters=api_pb2.GenerateParameters(
                max_new_tokens=NEW_TOKENS, adapter_id="one")), timeout=120)
        info = stub.Info(api_pb2.InfoRequest(), timeout=30)
    assert reply.generated_text == text
    assert {"one", "two"} <= {a.name for a in info.lora_adapters}
    for route, body, status in (
            ("/generate", {"inputs": prompt, "parameters": {"adapter_id": "nope"}}, 422),
            ("/v1/completions", {"model": "nope", "prompt": prompt}, 404),
            ("/generate", {"text": prompt, "lora_path": "nope"}, 400)):
        reply = requests.post(f"{server.url}{route}", json=body, timeout=30)
        assert reply.status_code == status, (route, reply.text)


def test_load_at_run_time_then_unload(server, expected, adapters, tmp_path):
    prompt = PROMPTS[1]
    bad = tmp_path / "empty"
    bad.mkdir()
    reply = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "bad", "lora_path": str(bad)})
    assert reply.status_code == 400 and "adapter_config.json" in reply.text
    reply = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=120,
                          json={"lora_name": "three", "lora_path": str(adapters["three"])})
    assert reply.status_code == 200, reply.text
    assert _generate(server, prompt, "three") == expected["three", prompt]
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert 'tgi_request_adapter_count{adapter="three"}' in metrics
    reply = requests.post(f"{server.url}/v1/unload_lora_adapter", timeout=120,
                          json={"lora_name": "three"})
    assert reply.status_code == 200, reply.text
    reply = requests.post(f"{server.url}/generate", timeout=30, json={
        "inputs": prompt, "parameters": {"adapter_id": "three"}})
    assert reply.status_code == 422
    assert _generate(server, prompt, "one") == expected["one", prompt]
