"""Every output of the real SmolLM2 follows its grammar: 20 JSON schemas and 10 regexes, greedy and
sampled, all in flight at once (so constrained rows share batches); vLLM's structured-output and
prompt fields on the OpenAI routes."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from tests.e2e.server import launch
from router.api.openapi import openapi_document
from tests.openapi_schemas import _to_json_schema, assert_matches

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
     "maxItems": 5},
    {"type": "array", "items": S, "maxItems": 3},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}, "handle": S},
        "required": ["id", "handle"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"email": {"type": "string",
                                                "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                      "y": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "subtitle": S}, "required": ["title"],
     "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {
        "type": "integer", "minimum": 0, "maximum": 10}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"point": {"type": "array", "items": {
        "type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 2}},
     "required": ["point"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"anyOf": [{"type": "object", "properties": {"cat": S}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": S}, "required": ["dog"],
                "additionalProperties": False}]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"enum": ["low", "mid", "high"]}},
     "required": ["level", "label"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                           "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"nullable": {"type": ["string", "null"], "maxLength": 8},
                                      "flag": {"type": "boolean"}}, "required": ["nullable", "flag"]},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"[0-9]{1,4}\.[0-9]{2}", r"#[0-9a-f]{6}",
           r"\d{4}-\d{2}-\d{2}", r"[a-z]{1,10}(_[a-z]{1,10}){0,2}", r"(\+|-)?[1-9][0-9]{0,3}",
           r"[A-Z]{2}\d{2} [A-Z]{3}", r"(red|green|blue), (small|large)"]


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    launched = launch([], tmp_path_factory.mktemp("structured"),
                      extra=["--max-input-tokens", "200", "--max-total-tokens", "400",
                             "--max-batch-prefill-tokens", "2048"])
    yield launched
    assert launched.stop() == 0


def _generate(server, prompt, grammar, do_sample):
    parameters = {"max_new_tokens": 150, "grammar": grammar, "details": True}
    if do_sample:
        parameters.update(do_sample=True, temperature=0.9, seed=11)
    reply = requests.post(f"{server.url}/generate", timeout=600,
                          json={"inputs": prompt, "parameters": parameters})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_every_output_follows_its_grammar(server, do_sample):
    jobs = [("Reply with JSON only.\n", {"type": "json", "value": schema}, schema)
            for schema in SCHEMAS]
    jobs += [("Answer: ", {"type": "regex", "value": pattern}, pattern) for pattern in REGEXES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: _generate(server, job[0], job[1], do_sample), jobs))
    for (_, _, spec), reply in zip(jobs, replies):
        text = reply["generated_text"]
        assert reply["details"]["finish_reason"] == "eos_token", (spec, text)
        if isinstance(spec, dict):
            jsonschema.validate(json.loads(text), spec)
        else:
            assert re.fullmatch(spec, text), (spec, text)


def test_a_grammar_the_lexer_gives_up_on_fails_its_request_with_the_reason(server):
    """llguidance finds a{1000000} too complex only as it meets it; the answer used to end there,
    as if complete ("a", finish stop). Now the request fails, saying why, and the server goes
    on."""
    body = {"inputs": "Answer: ", "parameters": {"max_new_tokens": 8, "grammar": {
        "type": "regex", "value": "a{1000000}"}}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert reply.status_code == 424, reply.text
    assert "the grammar could not go on" in reply.json()["error"]
    # it fails at its first token, before the stream opens: the stream answers the same 424
    streamed = requests.post(f"{server.url}/generate_stream", json=body, timeout=120)
    assert streamed.status_code == 424 and "the grammar could not go on" in streamed.text
    assert _generate(server, "Answer: ", {"type": "regex", "value": "(yes|no)"}, False)


def _post(server, path, body):
    reply = requests.post(f"{server.url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "n"]}
TAG = {"structures": [{"begin": "<function=paint>", "schema": COLOUR, "end": "</function>"}],
       "triggers": ["<function="]}
# a pattern the model follows: it writes the trigger itself, and the tag's schema holds after it
FEW_SHOT = ('Paint red twice.\n<function=paint>{"colour":"red","n":2}</function>\n'
            'Paint green once.\n<function=paint>{"colour":"green","n":1}</function>\n'
            'Paint red once.\n')


def test_vllm_structured_output_fields_hold_the_output(server):
    chat = {"messages": [{"role": "user", "content": "Is the sky blue? Answer."}],
            "max_tokens": 40}
    # a field no route reads is ignored, as vLLM ignores it
    jobs = [("/v1/chat/completions", {**chat, "guided_choice": ["yes, it is", "no (never)"],
                                      "not_a_field": 1}),
            ("/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 20,
                                 "structured_outputs": {"choice": ["yes", "no"]}}),
            ("/v1/chat/completions", {**chat, "guided_regex": r"[A-Z][a-z]{2,6}\."}),
            ("/v1/completions", {"prompt": "Code: ", "max_tokens": 20,
                                 "structured_outputs": {"regex": r"\d{3}-[a-z]{2}"}}),
            ("/v1/chat/completions", {**chat, "guided_json": json.dumps(COLOUR)}),
            ("/v1/completions", {"prompt": "JSON: ", "max_tokens": 40,
                                 "structured_outputs": {"json": COLOUR}}),
            ("/v1/chat/completions", {**chat, "guided_grammar": 'root ::= "A" | "B" "!"'}),
            ("/v1/chat/completions", {**chat, "guided_json": COLOUR,
                                      "guided_whitespace_pattern": "[ ]"}),
            ("/v1/completions", {"prompt": FEW_SHOT, "max_tokens": 40, "temperature": 0,
                                 "structured_outputs": {"structural_tag": TAG}})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: _post(server, *job), jobs))
    texts = [r["choices"][0].get("text", r["choices"][0].get("message", {}).get("content"))
             for r in replies]
    assert texts[0] in ("yes, it is", "no (never)") and texts[1] in ("yes", "no")
    assert re.fullmatch(r"[A-Z][a-z]{2,6}\.", texts[2])
    assert re.fullmatch(r"\d{3}-[a-z]{2}", texts[3])
    for text in texts[4:6]:
        jsonschema.validate(json.loads(text), COLOUR)
    assert texts[6] in ("A", "B!")
    jsonschema.validate(json.loads(texts[7]), COLOUR)
    assert not re.search(r"\s", texts[7].replace(" ", ""))  # whitespace only as the pattern says
    calls = re.findall(r"<function=paint>(.*?)</function>", texts[8], re.S)
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call), COLOUR)
    refused = requests.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        **chat, "guided_json": COLOUR, "response_format": {"type": "json_object"}})
    assert refused.status_code == 422
    assert "`response_format` and `guided_json` cannot be used together" in refused.text


def test_prompt_logprobs_are_the_tgi_routes_prefill_logprobs(server):
    prompt = "The capital of France is Paris, and"
    tgi = _post(server, "/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": 1, "details": True, "decoder_input_details": True}})
    prefill = tgi["details"]["prefill"]
    reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                              "prompt_logprobs": 2})
    entries = reply["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prefill) == reply["usage"]["prompt_tokens"]
    assert entries[0] is None and prefill[0]["logprob"] is None
    for entry, token in zip(entries[1:], prefill[1:]):
        own = entry[str(token["id"])]
        assert own["logprob"] == pytest.approx(token["logprob"], abs=1e-4)
        assert own["decoded_token"] == token["text"]
        ranked = sorted((e for e in entry.values() if e["rank"] is not None),
                        key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2] and ranked[0]["logprob"] >= own["logprob"]
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    for name, body in (("CompletionFinal", reply), ("ChatCompletion", chat)):
        assert_matches(name, body)  # TGI's document's schema, and ours, which names the field
        jsonschema.validate(body, {"components": _to_json_schema(openapi_document()["components"]),
                                   "$ref": f"#/components/schemas/{name}"})


def test_continue_final_message_and_continuous_usage(server):
    partial = "The three primary colours are red,"
    body = {"messages": [{"role": "user", "content": "Name the primary colours."},
                         {"role": "assistant", "content": partial}],
            "continue_final_message": True, "add_generation_prompt": False}
    rendered = _post(server, "/chat_tokenize", body)
    assert rendered["templated_text"].endswith(partial)
    closed = _post(server, "/chat_tokenize", {**body, "continue_final_message": False})
    assert not closed["templated_text"].endswith(partial)  # the template closes the turn
    answer = _post(server, "/v1/chat/completions", {**body, "max_tokens": 5, "temperature": 0})
    assert answer["usage"]["prompt_tokens"] == len(rendered["tokenize_response"])
    with requests.post(f"{server.url}/v1/chat/completions", stream=True, timeout=120, json={
            **body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}) as reply:
        chunks = [json.loads(line[5:]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {answer["usage"]["prompt_tokens"]}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == \
        answer["choices"][0]["message"]["content"]
