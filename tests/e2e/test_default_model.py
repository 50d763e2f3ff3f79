"""The README's serve command, end to end: no --model-id serves SmolLM2-135M-Instruct."""
import json

import pytest
import requests

from tests.e2e.server import launch

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    # the default model id; smaller limits only to keep the warm-up short in tests
    launched = launch([], tmp_path_factory.mktemp("default"),
                      extra=["--max-input-tokens", "500", "--max-total-tokens", "1024",
                             "--max-batch-prefill-tokens", "512"])
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


def test_the_shard_chose_the_default_dtype_of_its_device(server, real_model_dir):
    from shard.config import default_dtype

    info = requests.get(f"{server.url}/info", timeout=10).json()
    # bfloat16 on an x86 CPU with AVX2
    assert info["model_dtype"] == default_dtype(info["model_device_type"], real_model_dir)
    assert f"no --dtype: {info['model_dtype']}" in server.log()


def test_generate_answers_like_the_model(server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["generated_text"].startswith(" Paris")


def test_stream_of_a_chat_prompt_ends_on_eos(server):
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 64, "details": True}}
    with requests.post(f"{server.url}/generate_stream", json=body, stream=True, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:")]
    final = events[-1]
    assert final["details"]["finish_reason"] == "eos_token"
    assert "4" in final["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == final["generated_text"]
    assert events[-1]["token"]["special"] is True


def test_sglangs_generate_answers_as_tgis_from_text_ids_and_embeddings(server, real_model_dir):
    from tests.e2e.test_sglang_api import embeddings_of

    prompt = "The capital of France is"
    tgi = requests.post(f"{server.url}/generate", timeout=120, json={"inputs": prompt, "parameters": {
        "max_new_tokens": 8, "details": True, "decoder_input_details": True}}).json()
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    by_text = requests.post(f"{server.url}/generate", timeout=120, json={
        "text": prompt, "sampling_params": greedy, "return_logprob": True,
        "logprob_start_len": 0}).json()
    assert by_text["text"] == tgi["generated_text"]
    meta = by_text["meta_info"]
    for (logprob, token_id, _), expected in zip(meta["output_token_logprobs"],
                                                tgi["details"]["tokens"]):
        assert token_id == expected["id"] and logprob == pytest.approx(expected["logprob"],
                                                                       abs=1e-4)
    ids = [t["id"] for t in tgi["details"]["prefill"]]
    assert [t[1] for t in meta["input_token_logprobs"]] == ids
    by_ids = requests.post(f"{server.url}/generate", timeout=120,
                           json={"input_ids": ids, "sampling_params": greedy}).json()
    by_embeds = requests.post(f"{server.url}/generate", timeout=120, json={
        "input_embeds": embeddings_of(real_model_dir, ids), "sampling_params": greedy}).json()
    assert by_ids["text"] == by_embeds["text"] == tgi["generated_text"]


def test_a_request_id_continues_its_generation_as_one_longer_one_would(server):
    def one(request_id, prompt, max_new_tokens):
        reply = requests.post(f"{server.url}/api/generate-one", timeout=120, json={
            "request_id": request_id, "prompt": prompt, "stream_response": False,
            "generation_config": {"do_sample": False, "max_new_tokens": max_new_tokens}})
        assert reply.status_code == 200, reply.text
        return reply.text

    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    first, second = one("smol", prompt, 8), one("smol", "ignored", 8)
    assert first + second == one("smol-whole", prompt, 16)


def test_beam_search_over_http_equals_transformers(real_model_dir, tmp_path):
    import torch
    import transformers

    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    # the reference's dtype: in bf16 (the default here) a close score could part the beams
    float32_server = launch([], tmp_path, extra=["--dtype", "float32", "--max-input-tokens", "500",
                                                 "--max-total-tokens", "1024",
                                                 "--max-batch-prefill-tokens", "512"])
    try:
        reply = requests.post(f"{float32_server.url}/api/generate-one", timeout=120, json={
            "request_id": "smol-beams", "prompt": prompt, "stream_response": False,
            "generation_config": {"num_beams": 4, "do_sample": False, "length_penalty": 0.5,
                                  "max_new_tokens": 24}})
    finally:
        assert float32_server.stop() == 0
    assert float32_server.processes_left() == []
    assert reply.status_code == 200, reply.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir,
                                                                  dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reference.generate(ids, num_beams=4, length_penalty=0.5, do_sample=False,
                                 max_new_tokens=24)
    assert reply.text == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
