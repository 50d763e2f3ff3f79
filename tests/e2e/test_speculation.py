"""--speculate on SmolLM2: n-gram drafts verified inside continuous batching change no output."""
import concurrent.futures
import json

import pytest
import requests

from tests.e2e.server import launch

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]

PROMPTS = [
    "one, two, three, four, one, two, three, four, one, two, three, four, one, two,",
    "<|im_start|>user\nList the days of the week, twice.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
    "The lighthouse keeper walked along the shore. The lighthouse keeper walked along the",
]


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    launched = launch([], tmp_path_factory.mktemp("speculate"),
                      extra=["--dtype", "float32", "--speculate", "4", "--max-input-tokens", "500",
                             "--max-total-tokens", "1024", "--max-batch-prefill-tokens", "512"])
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


@pytest.fixture(scope="module")
def greedy_reference(real_model_dir):
    """transformers' greedy tokens for each prompt (float32, as the server runs)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir,
                                                              dtype=torch.float32).eval()
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


def _counters(server) -> dict[str, float]:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return {name: float(value) for name, _, value in
            (line.partition(" ") for line in text.splitlines())
            if name.startswith("tgi_speculation_")}


def _generate(server, prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 32, "ignore_eos": True,
                                             "details": True}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_answers_with_drafts_are_the_models_own_in_a_batch(server, greedy_reference):
    before = _counters(server)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _generate(server, p), PROMPTS))
    for answer, reference in zip(answers, greedy_reference):
        details = answer["details"]
        assert details["generated_tokens"] == 32
        assert [t["id"] for t in details["tokens"]] == reference
        assert "".join(t["text"] for t in details["tokens"]) == answer["generated_text"]
    after = _counters(server)
    drafted = after["tgi_speculation_draft_tokens"] - before["tgi_speculation_draft_tokens"]
    accepted = after["tgi_speculation_accepted_tokens"] - before["tgi_speculation_accepted_tokens"]
    assert 0 < accepted <= drafted, "the drafts were verified and some were accepted"
    assert after["tgi_speculation_acceptance_rate"] == pytest.approx(
        after["tgi_speculation_accepted_tokens"] / after["tgi_speculation_draft_tokens"])
    assert requests.get(f"{server.url}/info", timeout=30).json()["speculate"] == 4


def test_a_stream_sends_one_event_per_token_and_stops_where_asked(server, greedy_reference):
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 32, "details": True,
                                                 "stop": [" three, four, one"]}}
    with requests.post(f"{server.url}/generate_stream", json=body, stream=True,
                       timeout=300) as reply:
        events = [json.loads(line[5:]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data:")]
    final = events[-1]
    assert final["details"]["finish_reason"] == "stop_sequence"
    assert final["generated_text"].endswith(" three, four, one")
    assert final["details"]["generated_tokens"] == len(events)
    assert [e["token"]["id"] for e in events] == greedy_reference[0][:len(events)]
    assert "".join(e["token"]["text"] for e in events) == final["generated_text"]
    assert all(e["generated_text"] is None for e in events[:-1])


def test_openai_completions_count_every_accepted_token(server, greedy_reference):
    reply = requests.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": "tgi", "prompt": PROMPTS[3], "max_tokens": 32, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 32
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 32
