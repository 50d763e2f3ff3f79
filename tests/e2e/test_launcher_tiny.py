"""tgi-launcher end to end on a tiny random Llama: HTTP routes, streaming, clean stop."""
import json
import os

import pytest
import requests

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pullable(tmp_path_factory):
    """A directory the server may pull models from (--allowed-local-model-path)."""
    return tmp_path_factory.mktemp("pullable")


@pytest.fixture(scope="module")
def server(tiny_llama, pullable, tmp_path_factory):
    # answers are compared across batch sizes: float32 keeps the random model's near-tied scores
    # apart on every device (on CUDA the default dtype, float16, may flip one between batch sizes)
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("launch"),
                      extra=["--max-batch-total-tokens", "8192", "--block-size", "4",
                             "--dtype", "float32", "--allowed-local-model-path", str(pullable)])
    yield launched
    code = launched.stop()
    assert code == 0, launched.log()
    assert launched.processes_left() == []
    assert not os.path.exists(f"{launched.uds_path}-0")


def _sse(response):
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data:"):
            events.append(json.loads(line[len("data:"):]))
    return events


def test_generate_and_stream_agree(server):
    body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 12, "details": True}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    payload = reply.json()
    assert payload["details"]["generated_tokens"] == 12
    assert payload["details"]["finish_reason"] == "length"
    with requests.post(f"{server.url}/generate_stream", json=body, stream=True, timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = _sse(stream)
    assert [e["index"] for e in events] == list(range(1, 13))
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
    assert events[-1]["generated_text"] == payload["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in payload["details"]["tokens"]]


def test_info_health_and_validation(server):
    info = requests.get(f"{server.url}/info", timeout=10).json()
    assert info["max_total_tokens"] > info["max_input_tokens"] > 0
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    reply = requests.post(f"{server.url}/generate", json={"inputs": "", "parameters": {}}, timeout=10)
    assert reply.status_code == 422
    assert reply.json() == {"error": "Input validation error: `inputs` cannot be empty",
                            "error_type": "validation"}
    too_long = {"inputs": "a " * 2000, "parameters": {"max_new_tokens": 5}}
    reply = requests.post(f"{server.url}/generate", json=too_long, timeout=10)
    assert reply.status_code == 422 and reply.json()["error_type"] == "validation"
    reply = requests.post(f"{server.url}/generate", data=b"{not json", timeout=10)
    assert reply.status_code == 422 and reply.json()["error_type"] == "validation"


def test_concurrent_requests_are_batched_and_answer_like_alone(server):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Once upon a time {i}" for i in range(8)]

    def run(prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 6 + len(prompt) % 5}}
        return requests.post(f"{server.url}/generate", json=body, timeout=120).json()

    alone = [run(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone


def test_a_compiled_speculating_tiny_server_answers_as_the_eager_engine(tiny_llama, tmp_path):
    """--compile-decode, --speculate and --cuda-graphs reach the shard: the step is compiled at
    warm-up, greedy answers are the eager engine's own, and a CPU shard says it captures no CUDA
    graphs."""
    from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion

    prompt = "one two three one two three one two"
    engine = make_engine(tiny_llama)
    ids = engine.tokenizer.encode(prompt).ids
    want = run_to_completion(engine, [request(0, ids, BlockPool(64).take(len(ids) + 24, 4),
                                              max_new_tokens=24, ignore_eos=True)])[0]
    launched = launch(["--model-id", str(tiny_llama)], tmp_path,
                      extra=["--dtype", "float32",  # as make_engine loads it
                             "--compile-decode", "--speculate", "3", "--block-size", "4",
                             "--max-batch-total-tokens", "4096", "--cuda-graphs", "2,4"])
    try:
        reply = requests.post(f"{launched.url}/generate", timeout=120, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 24, "ignore_eos": True,
                                             "details": True}})
        assert reply.status_code == 200, reply.text
        assert [t["id"] for t in reply.json()["details"]["tokens"]] == want
        assert "decode step compiled" in launched.log()
        assert "--cuda-graphs 2,4: CUDA graphs are captured on CUDA devices only" in launched.log()
        metrics = requests.get(f"{launched.url}/metrics", timeout=30).text
        drafted = next(float(line.split()[1]) for line in metrics.splitlines()
                       if line.startswith("tgi_speculation_draft_tokens "))
        assert drafted > 0, "the repeating prompt's guesses were sent and verified"
    finally:
        assert launched.stop() == 0
    assert launched.processes_left() == []


# a pulled model's template that attacks as chat_template_kwargs ask: 2x10^7 loop steps, a string
# of 10^8 characters, or steps each too slow for the loop count to stop
HOSTILE = ("{% if attack == 'loop' %}{% for i in range(5000) %}{% for j in range(4000) %}"
           "{% endfor %}{% endfor %}{% elif attack == 'alloc' %}{% set s = 'a' * 100000000 %}"
           "{% else %}{% for i in range(100000) %}{{ range(100000) | join | length }}{% endfor %}"
           "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_a_hostile_chat_template_answers_422_while_other_models_chat(server, tiny_llama,
                                                                       pullable):
    import shutil
    import threading
    import time

    hostile = pullable / "hostile"
    shutil.copytree(tiny_llama, hostile)
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    (hostile / "tokenizer_config.json").write_text(json.dumps({**config,
                                                               "chat_template": HOSTILE}))
    url = server.url
    assert requests.post(f"{url}/v1/models/pull", json={"model": str(hostile), "id": "hostile"},
                         timeout=30).status_code == 200
    deadline = time.monotonic() + 60
    while requests.get(f"{url}/v1/models/hostile", timeout=10).json()["state"] != "downloaded":
        assert time.monotonic() < deadline, "the pull did not finish"
        time.sleep(0.1)
    started = requests.put(f"{url}/v1/models/hostile/start", timeout=120)
    assert started.json()["state"] == "running", started.text

    def chat(model, attack=None, headers=None):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if attack is not None:
            body["chat_template_kwargs"] = {"attack": attack}
        began = time.monotonic()
        reply = requests.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                              timeout=60)
        return reply, time.monotonic() - began

    try:
        # the slow one first, and four at once: they hold two of the pool's three workers, the
        # first two are stopped at 2 s, and the others are refused with their failure (or, on a
        # machine too busy to give those renders the CPU, stopped at 2 s in turn)
        hostile_replies = []
        attackers = [threading.Thread(target=lambda: hostile_replies.append(chat("hostile",
                                                                                 "slow-steps")))
                     for _ in range(4)]
        for thread in attackers:
            thread.start()
        others = []
        while any(t.is_alive() for t in attackers):
            others.append(chat("tgi"))  # the default model
        for thread in attackers:
            thread.join()
        assert sorted(r.status_code for r, _ in hostile_replies) == [422] * 4
        messages = sorted(r.json()["error"] for r, _ in hostile_replies)
        timed_out = "Template error: the chat template did not render within its 2 s"
        assert messages[:2] == [timed_out] * 2
        assert all(m == timed_out or "refused without rendering" in m for m in messages[2:])
        assert max(took for _, took in hostile_replies) < 6
        assert len(others) >= 5 and all(r.status_code == 200 for r, _ in others)
        assert max(took for _, took in others) < 1.0, others
        # each smaller than the last, so each is tried rather than refused as the last one was
        reply, took = chat("hostile", "alloc")
        assert reply.status_code == 422 and took < 1.0
        assert reply.json() == {"error": "Template error: the chat template built a value of "
                                         "100,000,000 characters or items, over its limit of "
                                         "8,000,000", "error_type": "template_error"}
        reply, took = chat("hostile", "loop", headers={"x-stainless-lang": "python"})
        assert reply.status_code == 422 and took < 1.0
        assert reply.json()["error"]["message"] == ("Template error: the chat template looped "
                                                    "more than 2,000,000 times")
        assert reply.json()["error"]["code"] == "template_error"  # OpenAI's shape to its SDK
        assert chat("tgi")[0].status_code == 200
    finally:
        requests.put(f"{url}/v1/models/hostile/stop", timeout=120)
        requests.delete(f"{url}/v1/models/hostile", timeout=30)


def test_an_fp8_server_answers_as_the_bf16_model_within_quantization_tolerance(tiny_llama,
                                                                              tmp_path):
    """--quantize fp8 over HTTP (on the CPU its dequantizing path, the card's arithmetic): each
    greedy token is the unquantized model's choice, or within a near-tie of it, given the same
    text so far (after a near-tie the texts may part, and each is then judged on its own)."""
    launched = launch(["--model-id", str(tiny_llama)], tmp_path,
                      extra=["--quantize", "fp8", "--dtype", "bfloat16", "--block-size", "4",
                             "--max-batch-total-tokens", "4096"])
    try:
        reply = requests.post(f"{launched.url}/generate", timeout=120, json={
            "inputs": "The quick brown fox jumps over", "parameters": {
                "max_new_tokens": 24, "ignore_eos": True, "details": True,
                "decoder_input_details": True}})
        assert reply.status_code == 200, reply.text
        details = reply.json()["details"]
        info = requests.get(f"{launched.url}/info", timeout=10).json()
        log = launched.log()
    finally:
        assert launched.stop() == 0
    assert info["quantization"] == "fp8 (--quantize)"
    # every projection of the 3 layers (q, k and v fused); the head stays in bf16, as TGI's
    assert "fp8 weights: 12 of 12 linear layers quantized" in log, log[-2000:]
    _assert_near_the_models_choices(tiny_llama, details)


def test_an_int8_kv_cache_server_answers_as_the_model_within_its_rounding(tiny_llama, tmp_path):
    """--kv-cache-dtype int8 over HTTP: a prompt, then a longer one sharing its first blocks, whose
    prefill continues the cached int8 prefix (on CUDA: Triton's decode and prefill kernels reading
    it in place; on the CPU: the C kernel). Each greedy token is the model's choice or within a
    near-tie of it, given the same text so far."""
    launched = launch(["--model-id", str(tiny_llama)], tmp_path,
                      extra=["--kv-cache-dtype", "int8", "--dtype", "float32", "--block-size",
                             "4", "--max-batch-total-tokens", "4096"])
    try:
        prompt = "The quick brown fox jumps over the lazy dog while"
        replies = [requests.post(f"{launched.url}/generate", timeout=120, json={
            "inputs": text, "parameters": {"max_new_tokens": 16, "ignore_eos": True,
                                           "details": True, "decoder_input_details": True}})
            for text in (prompt, prompt + " the cat sleeps on the warm mat")]
    finally:
        assert launched.stop() == 0
    for reply in replies:
        assert reply.status_code == 200, reply.text
        _assert_near_the_models_choices(tiny_llama, reply.json()["details"])


def _assert_near_the_models_choices(model_dir, details) -> None:
    """Each generated token within 0.05 nats of the float32 model's best given the text before
    it, three in four exactly its choice."""
    import torch
    import transformers

    prompt = [t["id"] for t in details["prefill"]]
    tokens = [t["id"] for t in details["tokens"]]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                             dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logprobs = logits.log_softmax(-1)
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (gaps < 0.05).all(), gaps.tolist()
    assert (gaps == 0).float().mean() >= 0.75, gaps.tolist()
