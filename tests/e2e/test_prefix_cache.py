"""The prefix cache never changes an answer, and /metrics counts its hits."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Answer briefly and truthfully. " * 3


def _answers(server):
    prompts = [SYSTEM + question for question in
               ("What is the capital of France?", "Name a colour.", "Count to three.",
                "What is the capital of France?")]

    def ask(prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
        return requests.post(f"{server.url}/generate", json=body, timeout=120).json()

    first = [ask(p) for p in prompts]  # one at a time: later ones find the earlier prefixes
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, prompts))
    return [[t["id"] for t in a["details"]["tokens"]] for a in first + together]


def _hits(server) -> float:
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tgi_prefix_cache_hits "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_greedy_answers_are_the_same_with_the_cache_on_and_off(model, tiny_llama, tmp_path,
                                                               request):
    if model == "smollm2":
        request.getfixturevalue("real_model_dir")
        args, extra = [], ["--max-input-tokens", "400", "--max-total-tokens", "512",
                           "--max-batch-prefill-tokens", "1024"]
    else:
        args, extra = ["--model-id", str(tiny_llama)], ["--max-batch-total-tokens", "8192",
                                                         "--block-size", "4"]
    results = {}
    for mode in ("off", "on"):
        server = launch(args, tmp_path / mode, extra=[*extra, "--prefix-caching", mode])
        try:
            results[mode] = _answers(server)
            results[f"{mode} hits"] = _hits(server)
            info = requests.get(f"{server.url}/info", timeout=10).json()
            assert info["prefix_caching"] is (mode == "on")
        finally:
            assert server.stop() == 0
    assert results["on"] == results["off"]
    assert results["off hits"] == 0
    assert results["on hits"] > 0
