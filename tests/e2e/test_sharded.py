"""--num-shard N serves the same greedy tokens as one shard (gloo tensor parallelism on CPU)."""
import pytest
import requests

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was"]


def _greedy_tokens(server, max_new_tokens=16):
    out = []
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
        reply = requests.post(f"{server.url}/generate", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        out.append([t["id"] for t in reply.json()["details"]["tokens"]])
    return out


def _serve_and_generate(model_args, tmp_path, num_shard, extra=()):
    server = launch(model_args, tmp_path / f"shards-{num_shard}",
                    extra=["--num-shard", str(num_shard), *extra])
    try:
        return _greedy_tokens(server)
    finally:
        assert server.stop() == 0
        assert server.processes_left() == []


def test_two_shards_equal_one_on_a_tiny_llama(tiny_llama, tmp_path):
    extra = ["--max-batch-total-tokens", "4096"]
    one = _serve_and_generate(["--model-id", str(tiny_llama)], tmp_path, 1, extra)
    two = _serve_and_generate(["--model-id", str(tiny_llama)], tmp_path, 2, extra)
    assert two == one


@pytest.mark.real_model
def test_three_shards_equal_one_on_smollm2(real_model_dir, tmp_path):
    extra = ["--max-input-tokens", "200", "--max-total-tokens", "256",
             "--max-batch-prefill-tokens", "256", "--max-batch-total-tokens", "4096"]
    one = _serve_and_generate([], tmp_path, 1, extra)
    three = _serve_and_generate([], tmp_path, 3, extra)
    assert three == one
