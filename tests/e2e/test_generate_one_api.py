"""/api/generate-one and /api/generate-batch end to end on a tiny model: a request_id continues its
generation from cached KV (the same text as one longer generation), an evicted session computes
its tokens again with the same answer, and nothing is left held once sessions expire."""
import time

import pytest
import requests

from tests.e2e.server import free_and_total_blocks, launch

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"do_sample": False, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("generate-one"),
                      extra=["--max-input-tokens", "200", "--max-total-tokens", "256",
                             "--max-batch-prefill-tokens", "256",
                             "--max-batch-total-tokens", "8192", "--block-size", "4",
                             "--session-ttl", "2"])
    yield launched
    assert launched.stop() == 0


def one(server, request_id, prompt=PROMPT, **fields):
    body = {"request_id": request_id, "prompt": prompt, "stream_response": False,
            "generation_config": GREEDY, **fields}
    reply = requests.post(f"{server.url}/api/generate-one", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.text


def session_blocks(server) -> float:
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tgi_kv_cache_session_blocks "):
            return float(line.split()[1])
    raise AssertionError("no tgi_kv_cache_session_blocks gauge")


def test_a_continuation_is_the_rest_of_one_longer_generation(server):
    first = one(server, "cont")
    second = one(server, "cont", prompt="this prompt is ignored")
    third = one(server, "cont", prompt="")
    longer = one(server, "whole", generation_config={"do_sample": False, "max_new_tokens": 18})
    assert first + second + third == longer
    everything = one(server, "cont", only_new_tokens=False,
                     generation_config={"do_sample": False, "max_new_tokens": 2})
    assert everything.startswith(PROMPT + first + second + third)
    streamed = requests.post(f"{server.url}/api/generate-one", timeout=60, json={
        "request_id": "streamed", "prompt": PROMPT, "generation_config": GREEDY})
    assert streamed.headers["content-type"].startswith("text/plain")
    assert streamed.text == first


def test_an_evicted_session_computes_its_tokens_again_with_the_same_answer(server):
    first = one(server, "evicted")
    deadline = time.monotonic() + 20
    while session_blocks(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_blocks(server) == 0, "the TTL let go of every session's blocks"
    free, total = free_and_total_blocks(server.url)
    assert free == total, f"{total - free} blocks still held after the sessions expired"
    # its tokens stayed: it continues, computing them again, as if it had kept its blocks
    second = one(server, "evicted", prompt="x")
    assert session_blocks(server) > 0
    longer = one(server, "evicted-whole", generation_config={"do_sample": False,
                                                             "max_new_tokens": 12})
    assert first + second == longer


def test_a_batch_runs_its_ids_together_in_order_and_continues_each(server):
    body = {"prompts": [{"request_id": "b1", "prompt": PROMPT},
                        {"request_id": "b2", "prompt": "Once upon a time"}],
            "generation_config": GREEDY}
    reply = requests.post(f"{server.url}/api/generate-batch", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answers = reply.json()
    assert [a["request_id"] for a in answers] == ["b1", "b2"]
    assert answers[0]["response"] == one(server, "alone", generation_config=GREEDY)
    body["prompts"].reverse()
    body["only_new_tokens"] = False
    again = requests.post(f"{server.url}/api/generate-batch", json=body, timeout=60).json()
    assert [a["request_id"] for a in again] == ["b2", "b1"]
    assert again[1]["prompt"] == PROMPT
    assert again[1]["response"].startswith(answers[0]["response"])
    assert len(again[1]["response"]) > len(answers[0]["response"])


def test_bad_bodies_are_4xx_and_a_client_that_leaves_keeps_its_session(server):
    reply = requests.post(f"{server.url}/api/generate-one", json={"prompt": "x"}, timeout=30)
    assert reply.status_code == 422 and "request_id" in reply.json()["error"]
    before = one(server, "leaver")
    with requests.post(f"{server.url}/api/generate-one", stream=True, timeout=60, json={
            "request_id": "leaver", "prompt": "", "generation_config": {
                "do_sample": False, "max_new_tokens": 150}}) as streamed:
        next(streamed.iter_content(chunk_size=None))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the cancelled call ends, the session is idle again
        reply = requests.post(f"{server.url}/api/generate-one", timeout=60, json={
            "request_id": "leaver", "prompt": "", "stream_response": False,
            "only_new_tokens": False, "generation_config": {"do_sample": False,
                                                            "max_new_tokens": 1}})
        if reply.status_code != 409:
            break
        time.sleep(0.1)
    assert reply.status_code == 200 and reply.text.startswith(PROMPT + before)


def test_beam_search_runs_beside_greedy_requests_and_frees_its_blocks(server):
    import concurrent.futures

    beams = {"do_sample": False, "num_beams": 3, "length_penalty": 1.0, "max_new_tokens": 8}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        beam_calls = [pool.submit(one, server, f"beam-{i}", generation_config=beams)
                      for i in range(2)]
        greedy_calls = [pool.submit(one, server, f"greedy-{i}") for i in range(2)]
        beam_texts = [c.result() for c in beam_calls]
        greedy_texts = [c.result() for c in greedy_calls]
    assert beam_texts[0] == beam_texts[1] and greedy_texts[0] == greedy_texts[1]
    assert greedy_texts[0] == one(server, "greedy-alone")
    streamed = requests.post(f"{server.url}/api/generate-one", timeout=60, json={
        "request_id": "beam-streamed", "prompt": PROMPT, "generation_config": beams})
    assert streamed.text == beam_texts[0]
    # a beam call's session continues (its tokens are computed again)
    more = one(server, "beam-0", prompt="", generation_config=beams)
    assert isinstance(more, str)
    sampled = one(server, "beam-sampled", generation_config={**beams, "do_sample": True,
                                                              "temperature": 0.7, "top_k": 20})
    assert isinstance(sampled, str)
    deadline = time.monotonic() + 20
    while session_blocks(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    free, total = free_and_total_blocks(server.url)
    assert free == total, f"{total - free} blocks still held"
