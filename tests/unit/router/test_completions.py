"""OpenAI's legacy /v1/completions: best_of, response_format, usage and the model field."""
import pytest

from router.api.openai.completions import _best
from router.core.generation import GenerateResult
from router.schemas import GenerateRequest, SamplingParams, StoppingParams, Token
from tests.unit.router.test_api_errors import HealthyFake, _client


def _result(*logprobs: float) -> GenerateResult:
    return GenerateResult(tokens=[Token(1, "x", lp) for lp in logprobs])


def test_best_of_answers_the_n_most_likely_per_token_of_each_prompt():
    requests = [GenerateRequest(inputs=p, input_ids=[1], sampling=SamplingParams(seed=s),
                                stopping=StoppingParams(max_new_tokens=4))
                for p in ("a", "b") for s in range(3)]
    # per token, not summed: the 4-token candidate at -0.5 each beats the 1-token one at -1
    results = [_result(-1.0), _result(-0.5, -0.5, -0.5, -0.5), _result(-3.0),
               _result(-2.0), _result(-0.1), _result(-0.2, -0.2)]
    kept_requests, kept = _best(requests, results, 2, 3)
    assert kept == [results[1], results[0], results[4], results[5]]
    assert [(r.inputs, r.sampling.seed) for r in kept_requests] == [("a", 1), ("a", 0),
                                                                     ("b", 1), ("b", 2)]
    assert _best(requests, results, 3, 3) == (requests, results)


async def test_best_of_generates_the_candidates_and_counts_their_tokens(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)  # --max-best-of 2
    try:
        reply = await client.post("/v1/completions", json={
            "prompt": ["hello", "hello there"], "max_tokens": 3, "best_of": 2, "n": 1,
            "temperature": 1.0})
        body = await reply.json()
        assert reply.status == 200, body
        assert len(fake.requests) == 4  # two candidates for each prompt
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 4 * 3
        prompt_lengths = sorted({r.request.input_length for r in fake.requests.values()})
        assert body["usage"]["prompt_tokens"] == sum(prompt_lengths)  # each prompt once
    finally:
        await client.close()


@pytest.mark.parametrize("fields,expected", [
    ({"best_of": 1, "n": 2}, "`best_of` must be >= `n`"),
    ({"best_of": 2, "stream": True}, "`best_of` cannot be used with `stream`"),
    ({"best_of": 3}, "`best_of` must be >= 1 and <= 2"),
    ({"model": ["x"]}, "`model` must be a string"),
    ({"response_format": {"type": "regex", "value": "(("}}, "grammar is not valid"),
])
async def test_completion_fields_it_cannot_honour_are_422(tiny_llama, fields, expected):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           **fields})
        error = await reply.json()
        assert reply.status == 422 and expected in error["error"], error
    finally:
        await client.close()


async def test_response_format_constrains_a_completion(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}})
        assert reply.status == 200, await reply.text()
        (sent,) = fake.requests.values()
        kind, schema = sent.request.grammar
        assert kind == "json" and '"a"' in schema
    finally:
        await client.close()


async def test_streamed_chat_usage_counts_the_prompt_once_whatever_n(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
                "temperature": 1.0}
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        reply = await client.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        import json
        chunks = [json.loads(line[6:]) for line in (await reply.text()).splitlines()
                  if line.startswith("data: {")]
        assert chunks[-1]["usage"] == whole["usage"]
    finally:
        await client.close()


def test_openai_routes_write_a_token_without_probability_as_minus_9999():
    """-inf (a grammar's masked alternative, or one past a vanishing temperature) reaches the
    router as None, which JSON writes null where OpenAI's schema wants a number."""
    from router.api.openai.chat import _token_logprob
    from router.api.openai.completions import _logprobs

    result = GenerateResult(tokens=[Token(5, "b", None), Token(6, "c", -0.25)],
                            top_tokens=[[Token(5, "b", None)], [Token(6, "c", -0.25)]],
                            prefill=[Token(1, "a", None)])
    legacy = _logprobs(result, echo=True, prompt_length=1)
    assert legacy["token_logprobs"] == [None, -9999.0, -0.25]  # the prompt's first stays null
    assert legacy["top_logprobs"] == [{}, {"b": -9999.0}, {"c": -0.25}]
    assert _token_logprob(Token(5, "b", None))["logprob"] == -9999.0
    assert _token_logprob(Token(5, "b", float("-1e30")))["logprob"] == -9999.0


async def test_each_prompt_samples_with_its_own_seed_unless_one_is_given(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        body = {"prompt": ["hello", "hello"], "max_tokens": 2, "temperature": 1.0}
        assert (await client.post("/v1/completions", json=body)).status == 200
        seeds = [r.request.sampling.seed for r in fake.requests.values()]
        assert len(seeds) == 2 and seeds[0] != seeds[1]  # the same prompt twice: two samples
        fake.requests.clear()
        assert (await client.post("/v1/completions", json={**body, "seed": 7})).status == 200
        assert [r.request.sampling.seed for r in fake.requests.values()] == [7, 7]
    finally:
        await client.close()
