"""TGI's API end to end on a tiny model: every parameter, every validation rule, schemas, clients."""
import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from time import monotonic, sleep

import pytest
import requests

from tests.e2e.server import free_and_total_blocks, launch
from tests import openapi_schemas
from tests.openapi_schemas import assert_matches

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("tgi-api"),
                      extra=["--max-input-tokens", "64", "--max-total-tokens", "128",
                             "--max-batch-prefill-tokens", "256", "--max-batch-total-tokens", "8192",
                             "--block-size", "4",
                             # the adapters the tests load at run time lie under it
                             "--allowed-local-model-path", str(tmp_path_factory.getbasetemp())])
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


def post(server, path, body, **kw):
    return requests.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def sse(response):
    return [json.loads(line[5:]) for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data:")]


LONG = "The quick brown fox jumps over the lazy dog. " * 12  # 384 tokens
MEDIUM = "The quick brown fox jumps over the lazy dog. " * 3  # 96 tokens: over 64, under 128

RULES = [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -0.5}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2, "do_sample": True, "seed": 3}, "`seed` must not be set when `best_of` > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 65}, "`truncate` must be strictly positive and less than 64. Given: 65"),
    ({"max_new_tokens": 125}, "`inputs` tokens + `max_new_tokens` must be <= 128. Given: "),
    ({"grammar": {"type": "regex", "value": "[a-z"}}, "grammar is not valid: "),
    ({"grammar": {"type": "json", "value": {"type": "nonsense"}}}, "grammar is not valid: "),
    ({"grammar": {"type": "ebnf", "value": "x"}}, "grammar type 'ebnf' is not supported"),
    ({"adapter_id": "my-lora"}, "adapter 'my-lora' is not loaded"),
    ({"temperature": "hot"}, "Failed to deserialize the JSON body into the target type: "
                             "parameters.temperature"),
    ({"max_new_tokens": -1}, "parameters.max_new_tokens: invalid value"),
]


@pytest.mark.parametrize("params,message", RULES, ids=[m[:40] for _, m in RULES])
def test_validation_rule(server, params, message):
    reply = post(server, "/generate", {"inputs": "Hello there", "parameters": params})
    assert reply.status_code == 422, reply.text
    body = reply.json()
    assert body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: ")
    assert message in body["error"]
    assert_matches("ErrorResponse", body)


@pytest.mark.parametrize("body,message", [
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": MEDIUM, "parameters": {"max_new_tokens": 5}},
     "`inputs` must have less than 64 tokens. Given: 96"),
    ({"parameters": {}}, "missing field `inputs`"),
    ({"inputs": 5}, "inputs: invalid type"),
])
def test_input_rules(server, body, message):
    reply = post(server, "/generate", body)
    assert reply.status_code == 422 and message in reply.json()["error"]


@pytest.mark.parametrize("params,message", [
    ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when "
                                      "streaming tokens"),
])
def test_streaming_rules_answer_before_the_stream(server, params, message):
    reply = post(server, "/generate_stream", {"inputs": "Hi", "parameters": params})
    assert reply.status_code == 422
    assert message in reply.json()["error"]


def test_generate_details_match_the_schema(server):
    body = {"inputs": "Paris is the capital of", "parameters": {
        "max_new_tokens": 6, "details": True, "decoder_input_details": True, "top_n_tokens": 3,
        "return_full_text": True}}
    reply = post(server, "/generate", body)
    assert reply.status_code == 200
    payload = reply.json()
    assert_matches("GenerateResponse", payload)
    details = payload["details"]
    assert payload["generated_text"].startswith("Paris is the capital of")
    assert details["prefill"][0]["logprob"] is None
    assert all(p["logprob"] <= 0 for p in details["prefill"][1:])
    assert len(details["top_tokens"]) == 6 and all(len(t) == 3 for t in details["top_tokens"])
    assert [t["id"] for t in details["tokens"]] == [t[0]["id"] for t in details["top_tokens"]]
    for header in ("x-compute-time", "x-total-time", "x-queue-time", "x-inference-time",
                   "x-time-per-token", "x-validation-time"):
        assert header in reply.headers
    assert reply.headers["x-generated-tokens"] == "6"


def test_stream_events_match_the_schema(server):
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 5, "details": True,
                                                          "top_n_tokens": 2}}
    with post(server, "/generate_stream", body, stream=True) as reply:
        events = sse(reply)
    for event in events:
        assert_matches("StreamResponse", event)
    assert events[-1]["details"]["generated_tokens"] == 5
    assert events[-1]["details"]["input_length"] > 0


def test_compat_route_picks_json_or_sse(server):
    reply = post(server, "/", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert reply.status_code == 200
    body = reply.json()
    assert isinstance(body, list) and body[0]["generated_text"].startswith("Hello")
    with post(server, "/", {"inputs": "Hello", "parameters": {"max_new_tokens": 3},
                            "stream": True}, stream=True) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert len(sse(reply)) == 3


def test_best_of_returns_the_most_likely_and_the_others(server):
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 6, "best_of": 2,
                                                          "do_sample": True, "details": True}}
    details = post(server, "/generate", body).json()["details"]
    assert len(details["best_of_sequences"]) == 1
    best = sum(t["logprob"] for t in details["tokens"])
    other = details["best_of_sequences"][0]
    assert best >= sum(t["logprob"] for t in other["tokens"])
    assert details["seed"] is not None and other["seed"] is not None


def test_seed_reproduces_and_stop_sequence_is_kept(server):
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "do_sample": True,
                                                          "seed": 42, "details": True}}
    first, second = post(server, "/generate", body).json(), post(server, "/generate", body).json()
    assert first == second and first["details"]["seed"] == 42
    pieces = [t["text"] for t in first["details"]["tokens"]]
    stop_at = next(i for i, p in enumerate(pieces) if i >= 3 and p.strip() and "\ufffd" not in p)
    body["parameters"]["stop"] = [pieces[stop_at]]
    stopped = post(server, "/generate", body).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"] == "".join(pieces[:stop_at + 1])


def test_a_seeded_answer_is_the_same_alone_and_batched_with_others(server):
    """A sampling row's draws are keyed by its seed and positions, whatever shares its batch."""
    body = {"inputs": "Once upon a time", "parameters": {
        "max_new_tokens": 16, "do_sample": True, "seed": 5, "temperature": 0.8, "top_k": 40,
        "top_p": 0.95, "details": True}}
    alone = post(server, "/generate", body).json()
    others = [{"inputs": text, "parameters": {"max_new_tokens": 16, **params}}
              for text, params in (("The quick brown fox", {}),
                                   ("café au lait", {"do_sample": True, "seed": 6}),
                                   ("Once upon a time", {"do_sample": True, "seed": 9}))]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: post(server, "/generate", b).json(),
                                [*others, body, *others, body]))
    assert answers[3] == alone and answers[7] == alone


def test_truncate_keeps_the_last_tokens(server):
    body = {"inputs": LONG, "parameters": {"max_new_tokens": 2, "truncate": 10, "details": True,
                                            "decoder_input_details": True}}
    details = post(server, "/generate", body).json()["details"]
    assert len(details["prefill"]) == 10


def test_watermark_is_detectable(server, tiny_llama):
    from tokenizers import Tokenizer

    from shard.watermark import z_score

    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    prompt = "Once upon a time"
    last_prompt_token = tokenizer.encode(prompt).ids[-1]

    def tokens(watermark, seed):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 100, "do_sample": True,
                                                  "seed": seed, "watermark": watermark,
                                                  "details": True}}
        return [t["id"] for t in post(server, "/generate", body).json()["details"]["tokens"]]

    assert z_score(tokens(True, 1), 320, last_prompt_token) > 4
    assert abs(z_score(tokens(False, 1), 320, last_prompt_token)) < 3


def test_tokenize_info_health_metrics(server):
    tokens = post(server, "/tokenize", {"inputs": "Hello world"}).json()
    assert "".join(t["text"] for t in tokens) == "Hello world"
    assert_matches("TokenizeResponse", tokens)
    info = requests.get(f"{server.url}/info", timeout=10).json()
    assert_matches("Info", info)
    assert info["max_input_tokens"] == 64 and info["max_total_tokens"] == 128
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert "tgi_request_success" in metrics and "tgi_batch_current_size" in metrics


def _free_and_total_blocks(server):
    return free_and_total_blocks(server.url)


def test_200_dropped_streams_free_every_block(server):
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 60}}
    reference = post(server, "/generate", body).json()

    def drop_mid_stream(_):
        with requests.post(f"{server.url}/generate_stream", json=body, stream=True,
                           timeout=60) as reply:
            lines = reply.iter_lines()
            for line in lines:
                if line.startswith(b"data:"):
                    break
        # leaving the block closes the connection mid-generation

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(drop_mid_stream, range(200)))
    deadline_free = None
    for _ in range(100):
        free, total = _free_and_total_blocks(server)
        if free == total:
            deadline_free = free
            break
        import time
        time.sleep(0.1)
    assert deadline_free == total, f"{total - free} blocks still held"
    assert post(server, "/generate", body).json() == reference


def test_text_generation_client(server):
    from text_generation import AsyncClient, Client

    client = Client(server.url, timeout=60)
    response = client.generate("Once upon a time", max_new_tokens=5, decoder_input_details=True,
                               top_n_tokens=2)
    assert response.details.generated_tokens == 5 and response.details.prefill
    streamed = [r for r in client.generate_stream("Once upon a time", max_new_tokens=5)]
    assert "".join(r.token.text for r in streamed) == streamed[-1].generated_text
    assert streamed[-1].generated_text == response.generated_text
    best = client.generate("Once upon a time", max_new_tokens=4, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1

    async def run_async():
        async_client = AsyncClient(server.url, timeout=60)
        answer = await async_client.generate("Once upon a time", max_new_tokens=5)
        pieces = [r async for r in async_client.generate_stream("Once upon a time",
                                                                   max_new_tokens=5)]
        return answer, pieces

    answer, pieces = asyncio.run(run_async())
    assert answer.generated_text == response.generated_text
    assert pieces[-1].details.generated_tokens == 5


def test_huggingface_hub_inference_client(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(server.url)
    output = client.text_generation("Once upon a time", max_new_tokens=5, details=True)
    assert output.details.generated_tokens == 5
    chunks = list(client.text_generation("Once upon a time", max_new_tokens=5, details=True,
                                         stream=True))
    # it posts to the compatibility route, whose default (as in TGI) is the full text
    assert "Once upon a time" + "".join(c.token.text for c in chunks) == output.generated_text
    assert chunks[-1].generated_text == output.generated_text
    assert chunks[-1].details.finish_reason == "length"


def test_tgi_3s_json_schema_grammar_constrains_the_output(server):
    grammar = {"type": "json_schema", "value": {"name": "answer",
                                                "schema": {"enum": ["yes", "no"]}}}
    reply = post(server, "/generate", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 10, "grammar": grammar, "details": True}}).json()
    assert reply["generated_text"] in ('"yes"', '"no"')
    assert reply["details"]["finish_reason"] == "eos_token"
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
        "response_format": grammar}).json()
    assert chat["choices"][0]["message"]["content"] in ('"yes"', '"no"')


def test_completions_default_to_32_tokens_and_take_tgis_logit_bias_list(server):
    reply = post(server, "/v1/completions", {"prompt": "Hi", "ignore_eos": True}).json()
    assert reply["usage"]["completion_tokens"] == 32
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    as_map = post(server, "/v1/completions", {**body, "logit_bias": {"100": 100}}).json()
    as_list = post(server, "/v1/completions", {**body, "logit_bias": [0] * 100 + [100]}).json()
    plain = post(server, "/v1/completions", body).json()
    assert as_map["choices"][0]["text"] == as_list["choices"][0]["text"] != \
        plain["choices"][0]["text"]


def test_frequency_penalty_is_tgis_on_generate_and_openais_on_v1(server):
    """TGI's: the first token's logits already lose penalty * (count in the prompt / its
    length); OpenAI's counts the output only, so the first token is as without a penalty.

    Negative penalties lift the prompt's tokens into the top 5 of the tiny model's nearly flat
    distribution; between two of them, the difference of two penalties shows."""
    prompt = "a a a a a a b b c"
    ids = [t["id"] for t in post(server, "/tokenize", {"inputs": prompt}).json()]

    def first_top(penalty):
        params = {"max_new_tokens": 1, "details": True, "top_n_tokens": 5,
                  "frequency_penalty": penalty}
        top = post(server, "/generate", {"inputs": prompt, "parameters": params}).json()
        return {t["id"]: t["logprob"] for t in top["details"]["top_tokens"][0]}

    more, less = first_top(-2.0), first_top(-1.5)
    common = sorted(set(more) & set(less), key=ids.count)
    anchor = common[0]
    assert any(ids.count(token) != ids.count(anchor) for token in common), (ids, more, less)
    for token in common[1:]:
        expected = (less[token] - less[anchor]
                    + 0.5 * (ids.count(token) - ids.count(anchor)) / len(ids))
        assert abs(more[token] - more[anchor] - expected) < 1e-3, token

    def v1_first_top(penalty):
        reply = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 5,
                                                 "frequency_penalty": penalty}).json()
        return reply["choices"][0]["logprobs"]["top_logprobs"][0]

    unpenalised, v1_penalised = v1_first_top(0), v1_first_top(2.0)
    assert unpenalised.keys() == v1_penalised.keys()
    assert all(abs(unpenalised[k] - v1_penalised[k]) < 1e-4 for k in unpenalised)


def test_an_error_in_an_open_v1_stream_is_tgis_body_or_openais_to_the_sdk(server):
    """A grammar llguidance gives up on at its second token fails the stream after it opened:
    TGI's {"error", "error_type"} then [DONE], as TGI writes it; the OpenAI SDK raises its
    message."""
    import openai

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "response_format": {"type": "regex", "value": "(a|b)c{100000}"}}
    with post(server, "/v1/chat/completions", {**body, "stream": True}, stream=True) as reply:
        assert reply.status_code == 200
        frames = [line[6:] for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and len(frames) >= 3
    error = json.loads(frames[-2])
    assert error["error_type"] == "generation" and "the grammar could not go on" in error["error"]
    assert_matches("ErrorResponse", error)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    with pytest.raises(openai.APIError, match="the grammar could not go on"):
        for _ in client.chat.completions.create(model="m", stream=True, **body):
            pass


def _every_answer(model_id: str) -> list[tuple[str, str, dict | None, int]]:
    """(method, path, body, status): a request of every kind each route answers, errors too."""
    details = {"max_new_tokens": 2, "details": True, "top_n_tokens": 2}
    generate = {"inputs": "Hi", "parameters": {**details, "decoder_input_details": True,
                                               "best_of": 2, "do_sample": True}}
    streamed = {"inputs": "Hi", "parameters": details}
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "stop": "zzz"}
    completion = {"prompt": ["Hi", "Ho"], "max_tokens": 2, "logprobs": 2, "echo": True,
                  "stop": ["zzz"]}
    sglang = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    one = {"request_id": "openapi", "prompt": "Hi", "generation_config": {"max_new_tokens": 2}}
    ollama = {"model": model_id, "prompt": "Hi", "options": {"num_predict": 2}}
    ollama_chat = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}],
                   "options": {"num_predict": 2}}
    return [
        ("post", "/", streamed, 200), ("post", "/", {**streamed, "stream": True}, 200),
        ("post", "/generate", generate, 200), ("post", "/generate", sglang, 200),
        ("post", "/generate", {**sglang, "stream": True}, 200),
        ("post", "/generate_stream", streamed, 200),
        ("post", "/tokenize", {"inputs": "Hi"}, 200), ("post", "/chat_tokenize", chat, 200),
        ("post", "/invocations", streamed, 200), ("post", "/invocations", chat, 200),
        ("post", "/invocations", {"prompt": "Hi", "max_tokens": 2}, 200),
        ("get", "/health", None, 200), ("get", "/info", None, 200),
        ("get", "/metrics", None, 200), ("get", "/docs", None, 200), ("get", "/", None, 200),
        ("post", "/v1/chat/completions", chat, 200),
        ("post", "/v1/chat/completions", {**chat, "stream": True,
                                          "stream_options": {"include_usage": True}}, 200),
        ("post", "/v1/chat/completions", {**chat, "logit_bias": [0.0, 1.5],
                                          "response_format": {"type": "json_schema", "value": {
                                              "name": "n", "schema": {"enum": [1, 2]}}}}, 200),
        ("post", "/v1/completions", completion, 200),
        ("post", "/v1/completions", {**completion, "logprobs": None, "echo": False,
                                     "stream": True,
                                     "stream_options": {"include_usage": True}}, 200),
        ("get", "/v1/models", None, 200), ("get", f"/v1/models/{model_id}", None, 200),
        ("post", "/abort_request", {"rid": "nothing-running"}, 200),
        ("post", "/flush_cache", {}, 200), ("get", "/health_generate", None, 200),
        ("get", "/get_model_info", None, 200), ("get", "/get_server_info", None, 200),
        ("post", "/api/generate-one", one, 200),
        ("post", "/api/generate-batch", {"prompts": [{"request_id": "openapi-batch",
                                                      "prompt": "Hi"}],
                                         "generation_config": {"max_new_tokens": 2}}, 200),
        ("get", "/api/version", None, 200), ("get", "/api/tags", None, 200),
        ("get", "/api/ps", None, 200), ("post", "/api/show", {"model": model_id}, 200),
        ("post", "/api/generate", ollama, 200),
        ("post", "/api/generate", {**ollama, "stream": False}, 200),
        ("post", "/api/chat", {**ollama_chat, "stream": False}, 200),
        ("post", "/api/chat", ollama_chat, 200),
        ("post", "/api/chat", {**ollama_chat, "options": {"num_gpu": 1}}, 400),
        ("post", "/api/embed", {"model": model_id, "input": "Hi"}, 400),
        # this model generates only: test_embeddings_api serves embeddings
        ("post", "/v1/embeddings", {"input": "Hi"}, 400), ("post", "/embed", {"inputs": "Hi"}, 400),
        ("post", "/api/embeddings", {"model": model_id, "prompt": "Hi"}, 400),
        ("post", "/api/copy", {"source": model_id, "destination": "copy"}, 400),
        ("post", "/generate", {"inputs": "Hi", "parameters": {"top_k": 0}}, 422),
        ("post", "/generate_stream", {"inputs": ""}, 422),
        ("post", "/v1/chat/completions", {"messages": []}, 422),
        ("post", "/v1/completions", {"prompt": 5}, 422),
    ]


def test_openapi_document_describes_every_route_we_serve(server):
    """Every route is in the document, with every schema of TGI 2.2.1's, and what each route
    answers (each event of a stream, errors too) is what the document says."""
    doc = requests.get(f"{server.url}/api-doc/openapi.json", timeout=10).json()
    served = {"/", "/generate", "/generate_stream", "/tokenize", "/chat_tokenize", "/invocations",
              "/health", "/info", "/metrics",
              "/api-doc/openapi.json", "/docs", "/v1/chat/completions", "/v1/completions",
              "/v1/models", "/v1/embeddings", "/embed",
              # SGLang's companion routes (its /generate shares TGI's path)
              "/abort_request", "/flush_cache", "/health_generate", "/get_model_info",
              "/get_server_info", "/api/generate-one", "/api/generate-batch",
              # Ollama's
              "/api/generate", "/api/chat", "/api/tags", "/api/show", "/api/ps", "/api/copy",
              "/api/version", "/api/embed", "/api/embeddings"}
    # the lifecycle routes change what is served: test_model_lifecycle and test_ollama_api drive
    # them
    lifecycle = {"/v1/models/{model_id}", "/v1/models/{model_id}/start",
                 "/v1/models/{model_id}/stop", "/v1/models/start", "/v1/models/stop",
                 "/v1/models/pull", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                 "/api/pull", "/api/delete"}
    assert set(doc["paths"]) == served | lifecycle
    assert set(doc["paths"]["/v1/models/{model_id}"]) == {"get", "patch", "delete"}
    if openapi_schemas.SPEC.exists():  # else reported as skipped (tests/conftest.py)
        tgis = json.loads(openapi_schemas.SPEC.read_text())
        assert set(tgis["components"]["schemas"]) <= set(doc["components"]["schemas"])
        assert set(tgis["paths"]) <= set(doc["paths"])
    else:
        openapi_schemas.unchecked.add("every schema of TGI's document is served")
    model_id = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    problems, asked = [], set()
    for method, path, body, status in _every_answer(model_id):
        reply = requests.request(method, f"{server.url}{path}", timeout=60, json=body)
        assert reply.status_code == status, (path, body, reply.text)
        documented = path if path in doc["paths"] else "/v1/models/{model_id}"
        problems += openapi_schemas.answer_problems(doc, documented, method, reply)
        asked.add(path)
    assert not problems, "\n".join(problems)
    assert served - {"/api-doc/openapi.json"} <= asked


_CHAT = {"messages": [{"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 3}
_JSON = {"type": "object", "properties": {"a": {"type": "integer"}}}
# both forms of every union type of TGI 2.2.1's request schemas, and each of its grammar forms
EVERY_FORM = [
    ("/v1/chat/completions", {**_CHAT, "stop": "x"}),
    ("/v1/chat/completions", {**_CHAT, "stop": ["x", "y"]}),
    ("/v1/chat/completions", {**_CHAT, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "!"}]}]}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json", "value": _JSON}}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "regex", "value": "[a-z]+"}}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema", "value": {
        "name": "n", "schema": _JSON}}}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": _JSON}}}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {**_CHAT, "logit_bias": {"5": -100}}),
    ("/v1/chat/completions", {**_CHAT, "logit_bias": [0, 0, 0, 0, 0, -100]}),
    ("/v1/chat/completions", {**_CHAT, "n": 2, "seed": 7, "temperature": 0.7, "top_p": 0.9,
                              "frequency_penalty": 0.5, "presence_penalty": 0.5,
                              "logprobs": True, "top_logprobs": 2, "model": "anything"}),
    ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}],
                              "tool_choice": "none"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stop": "x"}),
    ("/v1/completions", {"prompt": ["Hi", "Ho"], "max_tokens": 3, "stop": ["x"], "seed": 3,
                         "temperature": 0.5, "top_p": 0.9, "frequency_penalty": 0.1,
                         "repetition_penalty": 1.1, "model": "anything"}),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "grammar": {
        "type": "json", "value": _JSON}}}),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "grammar": {
        "type": "json", "value": json.dumps(_JSON)}}}),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "grammar": {
        "type": "regex", "value": "[a-z]+"}}}),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "grammar": {
        "type": "json_schema", "value": {"name": "n", "schema": _JSON}}}}),
    ("/generate", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 3, "stop": ["x"], "watermark": True, "typical_p": 0.9,
        "repetition_penalty": 1.2, "frequency_penalty": 0.3, "top_k": 5, "seed": 1,
        "return_full_text": True, "truncate": 10, "adapter_id": ""}}),
    ("/", {"inputs": "Hi", "parameters": {"max_new_tokens": 3}, "stream": False}),
]


@pytest.mark.parametrize("path,body", EVERY_FORM, ids=[f"{p}-{i}" for i, (p, _) in
                                                       enumerate(EVERY_FORM)])
def test_every_form_of_tgis_request_schemas_is_served_as_documented(server, path, body):
    reply = post(server, path, body)
    assert reply.status_code == 200, reply.text
    doc = requests.get(f"{server.url}/api-doc/openapi.json", timeout=10).json()
    assert openapi_schemas.answer_problems(doc, path, "post", reply) == []


# ---- LoRA adapters a client loads: hostile files, and how many a model holds --------------------

@pytest.fixture(scope="module")
def lora_dir(tiny_llama, tmp_path_factory):
    from tests.lora_adapters import build_adapter

    return build_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "rank64", rank=64,
                         alpha=16, std=0.05)


def _load_adapter(server, name, path):
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def _unload_adapter(server, name):
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name})


class _SteadyLoad:
    """Short /generate requests one after another on a thread; each one's status and seconds."""

    def __init__(self, server):
        self.server, self.results, self._stop = server, [], False
        self._pool = ThreadPoolExecutor(1)
        self._done = self._pool.submit(self._run)

    def _run(self):
        while not self._stop:
            start = monotonic()
            try:
                status = post(self.server, "/generate", {"inputs": "Hello",
                                                         "parameters": {"max_new_tokens": 4}}
                              ).status_code
            except requests.RequestException as err:
                status = repr(err)
            self.results.append((status, monotonic() - start))

    def stop(self) -> list:
        self._stop = True
        self._done.result()
        self._pool.shutdown()
        return self.results


def test_adapters_with_backtracking_patterns_never_stall_the_shard(server, lora_dir, tmp_path):
    """rank_pattern / alpha_pattern keys that backtrack for minutes in Python's re (with, the
    second time, a module name that makes it worse): each load answers at once (the first
    loads, its keys matching nothing; the second is a 400 naming the module), while generate
    requests go on within two seconds each and the shard is never restarted."""
    from tests.hostile_adapters import with_backtracking_patterns, with_long_module_name

    pids = server.shard_pids()
    load = _SteadyLoad(server)
    sleep(0.5)  # requests already flowing when the first load arrives
    started = monotonic()
    first = _load_adapter(server, "backtracking", with_backtracking_patterns(lora_dir,
                                                                             tmp_path / "one"))
    second = _load_adapter(server, "long-name", with_long_module_name(lora_dir, tmp_path / "two"))
    took = monotonic() - started
    sleep(0.5)
    results = load.stop()
    assert first.status_code == 200, first.text
    assert second.status_code == 400
    error = second.json()["error"]
    assert "a.a.a.a" in error["message"] and "not a projection of this model" in \
        error["message"] and len(error["message"]) < 1000
    assert took < 10
    assert len(results) >= 5 and all(status == 200 for status, _ in results), results
    assert max(seconds for _, seconds in results) < 2.0, results
    adapted = post(server, "/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": 4, "adapter_id": "backtracking"}})
    assert adapted.status_code == 200  # the first serves
    assert _unload_adapter(server, "backtracking").status_code == 200
    assert server.shard_pids() == pids  # never restarted


def test_max_loras_refuses_a_load_past_it_and_an_unload_gives_memory_back(server, lora_dir):
    """--max-loras (16 by default): the 17th adapter is a 400 in OpenAI's shape and the 16 serve;
    unloading them gives their memory back to the system (the shard's resident memory falls by
    at least half of what they took), and a load after that succeeds."""
    from tests.hostile_adapters import resident_bytes

    assert requests.get(f"{server.url}/info", timeout=10).json()["max_loras"] == 16
    (pid,) = server.shard_pids().values()
    names = [f"bound-{i}" for i in range(16)]
    for name in names:
        assert _load_adapter(server, name, lora_dir).status_code == 200
    refused = _load_adapter(server, "one-too-many", lora_dir)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "--max-loras (16)" in error["message"] and error["http_status_code"] == 400
    for name in (names[0], names[-1]):
        reply = post(server, "/generate", {"inputs": "Hello",
                                           "parameters": {"max_new_tokens": 4, "adapter_id": name}})
        assert reply.status_code == 200
    full = resident_bytes(pid)
    for name in names:
        assert _unload_adapter(server, name).status_code == 200
    # what the stacks held, from the shard's own count after the first unload (RSS growth alone
    # undercounts them when they reuse memory earlier tests freed)
    fifteen = int(re.search(r"unloaded LoRA adapter bound-0 \(the adapters left hold (\d+) bytes",
                            server.log())[1])
    stacks = fifteen * 16 // 15
    assert stacks > 3 * 2**20  # 16 rank-64 adapters of the tiny model: 6 MiB of stacks
    assert full - resident_bytes(pid) >= stacks / 2
    assert "unloaded LoRA adapter bound-15 (the adapters left hold 0 bytes)" in server.log()
    assert _load_adapter(server, "after-unload", lora_dir).status_code == 200
    assert _unload_adapter(server, "after-unload").status_code == 200
