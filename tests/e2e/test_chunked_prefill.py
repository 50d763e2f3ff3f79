"""A long prompt prefilled in chunks, each carrying the running batch's step, answers like one prefill."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e

SHORT = ["Once upon a time", "The capital of France is", "def add(a, b):"]
LONG = "The lazy dog jumps over the quick brown fox again and again. " * 12


def _metric(server, name: str) -> float:
    total = 0.0
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.split()[-1])
    return total


def _ids(reply: dict) -> list[int]:
    return [t["id"] for t in reply["details"]["tokens"]]


def _run(server) -> tuple[list[list[int]], float]:
    """Each request's token ids, and how many prefills joined the running batch for the long
    prompt (one per chunk; TGI labels every join "chunking" when the shards chunk)."""
    def ask(prompt, new_tokens):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True,
                                                 "decoder_input_details": False}}
        reply = requests.post(f"{server.url}/generate", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(4) as pool:
        # long enough to be running still when the long prompt has joined, whole or in chunks
        running = [pool.submit(ask, p, 300) for p in SHORT]
        deadline = time.monotonic() + 60
        while _metric(server, "tgi_batch_current_size ") < len(SHORT):
            assert time.monotonic() < deadline, "the short requests never ran together"
            time.sleep(0.01)
        joins_before = _metric(server, 'tgi_batch_concat{reason="chunking"}')
        long = pool.submit(ask, LONG, 12)
        long_ids = _ids(long.result())
        joins = _metric(server, 'tgi_batch_concat{reason="chunking"}') - joins_before
        return [_ids(f.result()) for f in running] + [long_ids], joins


def test_chunked_prompt_beside_running_streams_answers_like_one_prefill(tiny_llama, tmp_path):
    results = {}
    for name, budget in (("chunked", "16"), ("whole", "512")):
        server = launch(["--model-id", str(tiny_llama)], tmp_path / name,
                        extra=["--max-batch-prefill-tokens", budget, "--max-batch-total-tokens",
                               "8192", "--prefix-caching", "off"])
        try:
            results[name], results[f"{name} joins"] = _run(server)
        finally:
            assert server.stop() == 0
    assert results["chunked"] == results["whole"]
    assert results["chunked joins"] > 1, "the running batch rode in each of the chunks"
    assert results["whole joins"] == 1, "the whole prompt joined in one prefill"
