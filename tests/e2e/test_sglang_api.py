"""SGLang's native /generate end to end on a tiny model: it answers as TGI's route does for the same
prompt, and each field has its observable effect."""
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from tests.e2e.server import free_and_total_blocks, launch
from tests.waiting import wait_until
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog"


# a prompt of 3,500 tokens: its hidden states are 224,000 numbers (4.5 MB of JSON)
LONG_PROMPT_TOKENS, WIDTH = 3500, 64
WRITE_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny Llama (the same weights) with room for a long prompt."""
    return build_tiny_model(tmp_path_factory.mktemp("long-llama"), hidden_size=WIDTH,
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(long_llama, tmp_path_factory):
    launched = launch(["--model-id", str(long_llama)], tmp_path_factory.mktemp("sglang-api"),
                      extra=["--max-input-tokens", "3600", "--max-total-tokens", "4096",
                             "--max-batch-prefill-tokens", "512",
                             "--max-batch-total-tokens", "8192", "--block-size", "4",
                             "--stream-write-timeout", str(WRITE_TIMEOUT_S)])
    yield launched
    assert launched.stop() == 0


def post(server, path, body, **kw):
    return requests.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def sglang(server, **fields):
    reply = post(server, "/generate", fields)
    assert reply.status_code == 200, reply.text
    return reply.json()


def greedy(max_new_tokens=12, **params):
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **params}


def events(reply):
    lines = (line.decode() for line in reply.iter_lines())  # SSE is UTF-8 by definition
    frames = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_greedy_text_equals_tgis_and_input_ids_equal_text(server):
    tgi = post(server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "details": True}}).json()
    out = sglang(server, text=PROMPT, sampling_params=greedy(ignore_eos=True))
    assert out["text"] == tgi["generated_text"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 12 == tgi["details"]["generated_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    ids = [t["id"] for t in post(server, "/tokenize", {"inputs": PROMPT}).json()]
    assert meta["prompt_tokens"] == len(ids)
    by_ids = sglang(server, input_ids=ids, sampling_params=greedy(ignore_eos=True))
    assert by_ids["text"] == out["text"]
    # the same prompt again: its full blocks come from the prefix cache
    assert by_ids["meta_info"]["cached_tokens"] >= 4


def test_batches_keep_order_and_n_gives_n_answers(server):
    prompts = ["Once upon a time", "Hello there", PROMPT]
    alone = [sglang(server, text=p, sampling_params=greedy(6))["text"] for p in prompts]
    batch = sglang(server, text=prompts, sampling_params=greedy(6), rid=["a", "b", "c"])
    assert [o["text"] for o in batch] == alone
    assert [o["meta_info"]["id"] for o in batch] == ["a", "b", "c"]
    several = sglang(server, text="Hello", sampling_params={"n": 3, "max_new_tokens": 5})
    assert len(several) == 3 and all(o["meta_info"]["completion_tokens"] <= 5 for o in several)


def test_stops_and_ignore_eos(server):
    full = sglang(server, text=PROMPT, sampling_params=greedy(20, ignore_eos=True))
    assert full["meta_info"]["completion_tokens"] == 20  # ignore_eos reaches max_new_tokens
    # a stop string from the middle of the greedy text
    text = full["text"]
    middle = next(i for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].strip())
    stop = text[middle:middle + 3]
    cut = text[:text.index(stop)]
    trimmed = sglang(server, text=PROMPT, sampling_params=greedy(20, stop=stop, ignore_eos=True))
    assert trimmed["text"] == cut
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = sglang(server, text=PROMPT, sampling_params=greedy(20, stop=[stop], no_stop_trim=True,
                                                             ignore_eos=True))
    assert kept["text"] == cut + stop
    # a stop token id (ignore_eos would ignore it too, as in SGLang): it ends the generation
    plain = sglang(server, text=PROMPT, sampling_params=greedy(20), return_logprob=True)
    tokens = [t[1] for t in plain["meta_info"]["output_token_logprobs"]]
    target = tokens[len(tokens) // 2]
    ended = sglang(server, text=PROMPT, sampling_params=greedy(20, stop_token_ids=[target]),
                   return_logprob=True)
    assert ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert [t[1] for t in ended["meta_info"]["output_token_logprobs"]] == \
        tokens[:tokens.index(target) + 1]


def test_constrained_outputs_parse(server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["answer", "n"]}
    out = sglang(server, text=["Reply:", "Reply:"], sampling_params=[
        {"json_schema": json.dumps(schema), "max_new_tokens": 40},
        {"regex": "(yes|no) [0-9]", "max_new_tokens": 40}])
    value = json.loads(out[0]["text"])
    assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9
    assert re.fullmatch("(yes|no) [0-9]", out[1]["text"])
    ebnf = sglang(server, text="Reply:", sampling_params={
        "ebnf": 'root ::= ("yes" | "no") " " [1-9]', "max_new_tokens": 40})
    assert re.fullmatch("(yes|no) [1-9]", ebnf["text"])


def test_logprobs_equal_tgis_details(server):
    tgi = post(server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "details": True, "decoder_input_details": True,
        "top_n_tokens": 2}}).json()["details"]
    out = sglang(server, text=PROMPT, sampling_params=greedy(6, ignore_eos=True),
                 return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, tgi["prefill"][0]["id"],
                                               tgi["prefill"][0]["text"]]
    for (logprob, token_id, text), expected in zip(meta["input_token_logprobs"][1:],
                                                   tgi["prefill"][1:]):
        assert token_id == expected["id"] and text == expected["text"]
        assert logprob == pytest.approx(expected["logprob"], abs=1e-4)
    for (logprob, token_id, _), expected in zip(meta["output_token_logprobs"], tgi["tokens"]):
        assert token_id == expected["id"]
        assert logprob == pytest.approx(expected["logprob"], abs=1e-4)
    tops = sglang(server, text=PROMPT, sampling_params=greedy(6, ignore_eos=True),
                  return_logprob=True, top_logprobs_num=2)["meta_info"]
    assert tops["input_token_logprobs"] == []
    for step, expected in zip(tops["output_top_logprobs"], tgi["top_tokens"]):
        assert [t[1] for t in step] == [t["id"] for t in expected]
    later = sglang(server, text=PROMPT, sampling_params=greedy(2), return_logprob=True,
                   logprob_start_len=3)["meta_info"]
    assert [t[1] for t in later["input_token_logprobs"]] == [t["id"] for t in tgi["prefill"][3:]]


def embeddings_of(model_dir, ids) -> list[list[float]]:
    """The rows the model's embedding table gives these ids, read from its weights."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    return table[ids].float().tolist()


def test_input_embeds_answer_as_their_ids_do(server, long_llama):
    ids = [t["id"] for t in post(server, "/tokenize", {"inputs": PROMPT}).json()]
    by_ids = sglang(server, input_ids=ids, sampling_params=greedy(ignore_eos=True))
    by_embeds = sglang(server, input_embeds=embeddings_of(long_llama, ids),
                       sampling_params=greedy(ignore_eos=True))
    assert by_embeds["text"] == by_ids["text"]
    assert by_embeds["meta_info"]["prompt_tokens"] == len(ids)
    assert by_embeds["meta_info"]["cached_tokens"] == 0  # vectors never match the prefix cache
    batch = sglang(server, input_embeds=[embeddings_of(long_llama, ids),
                                         embeddings_of(long_llama, ids[:4])],
                   sampling_params=greedy(4, ignore_eos=True))
    assert batch[0]["text"] == by_ids["text"][:len(batch[0]["text"])]
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [len(ids), 4]
    narrow = post(server, "/generate", {"input_embeds": [[0.0] * 5]})
    assert narrow.status_code == 400 and "hidden size" in narrow.json()["error"]["message"]


def test_named_token_ids_and_prompt_top_logprobs(server):
    first = sglang(server, text=PROMPT, sampling_params=greedy(4, ignore_eos=True),
                   return_logprob=True, logprob_start_len=0)["meta_info"]
    prompt_ids = [t[1] for t in first["input_token_logprobs"]]
    generated = [t[1] for t in first["output_token_logprobs"]]
    asked = sorted({prompt_ids[2], generated[0], 0})
    meta = sglang(server, text=PROMPT, sampling_params=greedy(4, ignore_eos=True),
                  return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                  token_ids_logprob=asked, return_text_in_logprobs=True)["meta_info"]
    named = meta["input_token_ids_logprobs"]
    assert named[0] is None and len(named) == len(prompt_ids)
    own = dict((i, lp) for lp, i, _ in named[2])[prompt_ids[2]]
    assert own == pytest.approx(meta["input_token_logprobs"][2][0], abs=1e-5)
    out = dict((i, lp) for lp, i, _ in meta["output_token_ids_logprobs"][0])[generated[0]]
    assert out == pytest.approx(meta["output_token_logprobs"][0][0], abs=1e-5)
    assert len(meta["output_token_ids_logprobs"]) == 4
    top = meta["input_top_logprobs"]
    assert top[0] is None and all(len(step) == 3 for step in top[1:])
    # greedy: each position's best guess tops its list, and it is at least the actual token
    for step, actual in zip(top[1:], meta["input_token_logprobs"][1:]):
        assert step[0][0] >= actual[0] - 1e-6 and step[0][0] >= step[-1][0]


def test_hidden_states_have_sglangs_shape(server):
    info = requests.get(f"{server.url}/get_model_info", timeout=10).json()
    out = sglang(server, text=PROMPT, sampling_params=greedy(3, ignore_eos=True),
                 return_hidden_states=True)
    meta = out["meta_info"]
    hidden = meta["hidden_states"]
    assert len(hidden) == meta["completion_tokens"] == 3
    assert len(hidden[0]) == meta["prompt_tokens"] and len(hidden[0][0]) == info["hidden_size"]
    assert all(len(row) == info["hidden_size"] for row in hidden[1:])
    plain = sglang(server, text=PROMPT, sampling_params=greedy(3, ignore_eos=True))
    assert plain["text"] == out["text"] and "hidden_states" not in plain["meta_info"]


def test_stream_ends_as_the_plain_answer(server):
    body = {"text": PROMPT, "sampling_params": greedy(10, ignore_eos=True)}
    plain = sglang(server, **body)
    with requests.post(f"{server.url}/generate", json={**body, "stream": True}, stream=True,
                       timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        frames = events(reply)
    assert len(frames) == 10
    assert frames[-1]["text"] == plain["text"]
    assert frames[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])
    assert all(plain["text"].startswith(f["text"]) for f in frames)


def _free_and_total_blocks(server):
    return free_and_total_blocks(server.url)


def test_abort_request_frees_the_blocks_and_companion_routes(server):
    body = {"text": PROMPT, "rid": "long", "stream": True,
            "sampling_params": {"max_new_tokens": 440, "ignore_eos": True}}
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=60) as reply:
        lines = (line.decode() for line in reply.iter_lines())
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        busy = post(server, "/flush_cache", {})
        assert busy.status_code == 400
        assert post(server, "/abort_request", {"rid": "long"}).status_code == 200
        frames = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: ") and line != "data: [DONE]"]
    last = frames[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 440
    for _ in range(100):
        free, total = _free_and_total_blocks(server)
        if free == total:
            break
        time.sleep(0.05)
    assert free == total, f"{total - free} blocks still held"
    assert post(server, "/flush_cache", {}).status_code == 200
    assert _free_and_total_blocks(server)[0] == total
    assert requests.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    info = requests.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["is_generation"] is True
    assert requests.get(f"{server.url}/get_server_info", timeout=10).json()["version"]


def test_refusals_name_what_is_not_supported(server):
    for fields, words in (({"custom_logit_processor": "x"}, "serialized Python"),
                          ({"image_data": "a.png"}, "text only"),
                          ({"input_embeds": [[0.0]], "text": None}, "hidden size")):
        reply = post(server, "/generate", {"text": "Hi", **fields})
        assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    neither = post(server, "/generate", {"prompt": "Hi"})
    assert neither.status_code == 422 and "`text`" in neither.json()["error"]
    # SGLang answers an adapter it has not loaded with a 400
    unknown = post(server, "/generate", {"text": "Hi", "lora_path": "x"})
    assert unknown.status_code == 400 and "adapter 'x' is not loaded" in \
        unknown.json()["error"]["message"]


def test_sglang_habits_scoring_stream_interval_and_unknown_fields(server):
    """What SGLang clients rely on: a prompt scored with max_new_tokens 0 (as lm-eval's sglang
    backend does), a chunk every stream_interval tokens, newer fields ignored, 400s."""
    tgi = post(server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 1, "details": True, "decoder_input_details": True}}).json()["details"]
    scored = sglang(server, text=PROMPT, return_logprob=True, logprob_start_len=0,
                    sampling_params={"max_new_tokens": 0}, a_newer_field=True)
    meta = scored["meta_info"]
    assert scored["text"] == "" and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and meta["finish_reason"]["length"] == 0
    assert [t[1] for t in meta["input_token_logprobs"]] == [t["id"] for t in tgi["prefill"]]
    for got, want in zip(meta["input_token_logprobs"][1:], tgi["prefill"][1:]):
        assert got[0] == pytest.approx(want["logprob"], abs=1e-4)
    reply = post(server, "/generate", {"text": PROMPT, "stream": True, "sampling_params":
                                       greedy(7, ignore_eos=True, stream_interval=3)}, stream=True)
    frames = events(reply)
    assert [f["meta_info"]["completion_tokens"] for f in frames] == [3, 6, 7]
    whole = sglang(server, text=PROMPT, sampling_params=greedy(7, ignore_eos=True))
    assert frames[-1]["text"] == whole["text"]
    for body, words in (({"session_params": {"id": "s"}}, "whole conversation"),
                        ({"sampling_params": {"temperature": -1}}, "temperature"),
                        ({"sampling_params": {"newer": 1}}, "sampling_params.newer")):
        reply = post(server, "/generate", {"text": "Hi", **body})
        assert reply.status_code == 400 and words in reply.json()["error"]["message"]


def _health_latencies(server, stop: threading.Event) -> list[float]:
    """GET /health, one after another, until `stop`: each answer's seconds."""
    took = []
    with requests.Session() as session:
        while not stop.is_set():
            started = time.monotonic()
            assert session.get(f"{server.url}/health", timeout=30).status_code == 200
            took.append(time.monotonic() - started)
            time.sleep(0.01)
    return took


def test_a_long_prompts_hidden_states_stream_once_and_health_stays_fast(server):
    ids = [3 + (i * 7) % 300 for i in range(LONG_PROMPT_TOKENS)]
    body = {"input_ids": ids, "return_hidden_states": True, "stream": True,
            "sampling_params": greedy(16, ignore_eos=True)}
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        health = pool.submit(_health_latencies, server, stop)
        try:
            with requests.post(f"{server.url}/generate", json=body, stream=True,
                               timeout=120) as reply:
                assert reply.status_code == 200
                raw = b"".join(reply.iter_content(1 << 16))
        finally:
            stop.set()
        latencies = health.result()
    frames = [json.loads(line[6:]) for line in raw.split(b"\n")
              if line.startswith(b"data: {")]
    hidden = [f["meta_info"]["hidden_states"] for f in frames]
    # each frame carries its own step's hidden state: the prompt's rows in the first only
    assert len(frames) == 16 and [len(h) for h in hidden] == [1] * 16
    assert len(hidden[0][0]) == LONG_PROMPT_TOKENS and len(hidden[0][0][0]) == WIDTH
    assert all(len(h[0]) == WIDTH for h in hidden[1:])
    # bytes linear in the numbers sent (a float is at most 24 characters), not the 16 copies of
    # the prompt's rows that made 40 MB
    numbers = (LONG_PROMPT_TOKENS + 15) * WIDTH
    assert len(raw) < numbers * 25 + 16 * 4096, len(raw)
    # the encoding ran off the event loop: /health answered as fast as ever meanwhile (while
    # each frame was encoded on it, /health waited half a second)
    assert len(latencies) >= 5 and max(latencies) < 0.25, sorted(latencies)[-5:]


def _router_rss_mb(server) -> float:
    pid = next(int(line.split()[0]) for line in server.processes_left()
               if " -m router " in line)
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def _blocks_held(server) -> bool:
    free, total = _free_and_total_blocks(server)
    return free < total


def test_a_client_that_stops_reading_logprobs_is_cut_and_holds_no_memory(server):
    # 320 named log-probabilities a token make a frame of 10 KB: 400 tokens fill any socket
    # buffer, and frames that re-sent every earlier token's took the router to gigabytes
    body = json.dumps({"text": PROMPT, "stream": True, "return_logprob": True,
                       "token_ids_logprob": list(range(320)),
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
    before = peak = _router_rss_mb(server)
    url = urlparse(server.url)
    peer = socket.socket()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        peer.connect((url.hostname, url.port))
        peer.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # it reads nothing: its generation runs to its end and lets go of its blocks, and other
        # clients are served meanwhile
        wait_until(lambda: _blocks_held(server), "the generation to start")
        wait_until(lambda: not _blocks_held(server), "the generation to end", timeout=60)
        ended = time.monotonic()
        assert sglang(server, text="Hi", sampling_params=greedy(4))["meta_info"]
        while time.monotonic() - ended < WRITE_TIMEOUT_S:
            peak = max(peak, _router_rss_mb(server))
            time.sleep(0.1)
        assert peak - before < 150, f"the router grew from {before:.0f} to {peak:.0f} MB"
        # --stream-write-timeout cut the stream: what the buffers held, then the end, before
        # the whole answer (nor its [DONE]) was sent
        peer.settimeout(30)
        tail = b""
        try:
            while chunk := peer.recv(1 << 20):
                tail = (tail + chunk)[-64:]
        except ConnectionResetError:
            pass
        assert b"[DONE]" not in tail
    finally:
        peer.close()
    assert "stream cut: the client took nothing for 2 s" in server.log()
