"""vLLM's structured-output and prompt fields on the OpenAI routes (the scripted shard's tokens
are "t1 ", "t2 ", ...): each does what vLLM does or is a 422 naming it; unknown fields are
ignored with one warning a name."""
import json
import logging
import re

import llguidance
import pytest

from router.api.openai import guided, vllm_fields
from router.errors import TemplateError, ValidationError
from router.schemas import FinalInfo, FinishReason, Token, TokenEvent
from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.unit.router.test_chat_template import _model_with_template

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,kind", [
    ({"guided_json": SCHEMA}, "json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json"),
    ({"guided_regex": "[a-z]+"}, "regex"),
    ({"guided_choice": ["yes", "no"]}, "regex"),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "ebnf"),
    ({"structured_outputs": {"json": SCHEMA}}, "json"),
    ({"structured_outputs": {"json_object": True}}, "json"),
    ({"structured_outputs": {"regex": "x+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}}, "regex"),
    ({"structured_outputs": {"choices": ["a"]}}, "regex"),  # vLLM's documentation's spelling
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "ebnf"),
    ({"guided_regex": "x", "guided_decoding_backend": "guidance:disable-any-whitespace"}, "regex"),
    ({"response_format": {"type": "json_object"}}, "json"),
])
def test_each_field_is_a_grammar(body, kind):
    assert guided.constraint(body)[0] == kind


def test_no_field_no_grammar():
    assert guided.constraint({"response_format": {"type": "text"}}) is None
    assert guided.constraint({"guided_json": None}) is None


@pytest.mark.parametrize("choices", [["yes", "no"], ["a.b", "a+b", "(x)|[y]", "~#&-^$", "", "é\n"]])
def test_a_choice_pattern_matches_exactly_its_choices(choices):
    pattern = guided.choice_pattern("guided_choice", choices)
    assert not llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_regex(pattern))
    for choice in choices:
        assert re.fullmatch(pattern, choice)
    assert not re.fullmatch(pattern, choices[0] + "x")


def test_a_structural_tag_becomes_a_grammar_between_its_tags():
    tag = {"structures": [{"begin": "<function=f>", "schema": SCHEMA, "end": "</function>"}],
           "triggers": ["<function="]}
    kind, lark = guided.constraint({"structured_outputs": {"structural_tag": json.dumps(tag)}})
    assert kind == "ebnf" and '"<function="' in lark and "</function>" in lark


def test_a_whitespace_pattern_reaches_the_json_grammar():
    kind, schema = guided.constraint({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"})
    assert json.loads(schema)["x-guidance"] == {"whitespace_pattern": " ?"}
    _, schema = guided.constraint({"structured_outputs": {"json": SCHEMA,
                                                          "whitespace_pattern": "[ ]*"}})
    assert json.loads(schema)["x-guidance"] == {"whitespace_pattern": "[ ]*"}


@pytest.mark.parametrize("body,said", [
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
     "`response_format` and `guided_json` cannot be used together"),
    ({"guided_regex": "x", "guided_choice": ["a"]},
     "`guided_regex` and `guided_choice` cannot be used together"),
    ({"guided_regex": "x", "structured_outputs": {"regex": "y"}},
     "`guided_regex` and `structured_outputs.regex` cannot be used together"),
    ({"structured_outputs": {"regex": "x", "json": SCHEMA}}, "exactly one of"),
    ({"structured_outputs": {}}, "it holds none"),
    ({"structured_outputs": {"regex": "x", "backend": "x"}}, "`structured_outputs.backend`"),
    ({"structured_outputs": {"json_object": False}}, "`structured_outputs.json_object` must be"),
    ({"structured_outputs": "x"}, "`structured_outputs` must be an object"),
    ({"guided_choice": []}, "`guided_choice` must be a non-empty list of strings"),
    ({"guided_choice": "yes"}, "`guided_choice` must be a non-empty list of strings"),
    ({"guided_regex": ["x"]}, "`guided_regex` must be a string"),
    ({"guided_regex": "(unclosed"}, "`guided_regex`: grammar is not valid"),
    ({"guided_json": "{not json"}, "`guided_json` is not valid: the JSON schema is not JSON"),
    ({"guided_grammar": "root ::= \"a"}, "`guided_grammar`: grammar is not valid"),
    ({"guided_regex": "x", "guided_decoding_backend": "xgrammar"},
     "`guided_decoding_backend` 'xgrammar' is not served"),
    ({"guided_regex": "x", "guided_decoding_backend": "guidance:whitespace"}, "is not served"),
    ({"guided_regex": "x", "guided_whitespace_pattern": " "}, "needs a JSON constraint"),
    ({"guided_whitespace_pattern": " "}, "needs a JSON constraint"),
    # once a TypeError (a 500) merging the pattern into the schema's options
    ({"guided_json": {**SCHEMA, "x-guidance": 5}, "guided_whitespace_pattern": " "},
     "`guided_whitespace_pattern` needs the schema's `x-guidance` to be an object"),
    ({"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}}},
     "`structured_outputs.structural_tag` must be"),
    ({"structured_outputs": {"structural_tag": {"structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<g"]}}},
     "starts with none of the `triggers`"),
    ({"structured_outputs": {"structural_tag": {"structures": [
        {"begin": "<f>", "schema": True, "end": "</f>"}], "triggers": ["<f"]}}},
     "`structured_outputs.structural_tag.structures[0].schema` must be a JSON schema object"),
])
def test_what_cannot_be_served_is_a_422_naming_the_field(body, said):
    with pytest.raises(ValidationError, match=re.escape(said)):
        guided.constraint(body)


def test_forced_tools_and_a_guided_field_are_refused_together():
    with pytest.raises(ValidationError, match="`tools` and `guided_json` cannot be used together"):
        guided.constraint({"guided_json": SCHEMA}, tool_grammar=("json", "{}"))


def test_prompt_logprobs_entries_have_vllms_shape():
    prefill = [Token(5, "a", None), Token(7, "b", -0.5), Token(9, "c", None)]
    tops = [[], [Token(3, "x", -0.1), Token(7, "b", -0.5)], [Token(3, "x", -0.2)]]
    assert vllm_fields.prompt_logprobs_entries(prefill, tops) == [
        None,
        {"7": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
         "3": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}},
        {"9": {"logprob": -9999.0, "rank": None, "decoded_token": "c"},
         "3": {"logprob": -0.2, "rank": 1, "decoded_token": "x"}}]
    assert vllm_fields.prompt_logprobs_entries(prefill[:2], None) == [
        None, {"7": {"logprob": -0.5, "rank": None, "decoded_token": "b"}}]


@pytest.mark.parametrize("body,said", [
    ({"prompt_logprobs": 1, "stream": True}, "are not available when `stream=True`"),
    ({"prompt_logprobs": -1}, "the whole vocabulary) is not served"),
    ({"prompt_logprobs": 6}, "`prompt_logprobs` must be >= 0 and <= 5"),
    ({"prompt_logprobs": "1"}, "`prompt_logprobs` must be an integer"),
])
def test_prompt_logprobs_are_checked(body, said):
    with pytest.raises(ValidationError, match=re.escape(said)):
        vllm_fields.prompt_logprobs(body, 5)


def test_the_prompt_is_cut_after_the_final_message_as_transformers_cuts_it():
    assert vllm_fields.continued("<u>hi</u><a>The sky is</a>", "The sky is") == "<u>hi</u><a>The sky is"
    # a template that strips the message's trailing space: cut after the stripped text
    assert vllm_fields.continued("<a>The sky</a>", "The sky ") == "<a>The sky"
    assert vllm_fields.continued("<a>The sky </a>", "The sky ") == "<a>The sky "
    assert vllm_fields.continued("x</a>", None) == "x</a>"
    with pytest.raises(TemplateError, match="does not appear"):
        vllm_fields.continued("<a>changed</a>", "original")


def test_generation_prompt_fields():
    messages = [{"role": "assistant", "content": "Once"}]
    assert vllm_fields.generation_prompt({}, messages) == vllm_fields.GenerationPrompt(True, None)
    assert vllm_fields.generation_prompt({"add_generation_prompt": False}, messages) == \
        vllm_fields.GenerationPrompt(False, None)
    assert vllm_fields.generation_prompt({"continue_final_message": True}, messages) == \
        vllm_fields.GenerationPrompt(False, "Once")
    with pytest.raises(ValidationError, match="Cannot set both `continue_final_message` and"):
        vllm_fields.generation_prompt({"continue_final_message": True,
                                       "add_generation_prompt": True}, messages)


def test_running_usage_counts_each_stream():
    running = vllm_fields.RunningUsage([4, 6], True)
    event = TokenEvent(Token(1, "a", -1.0))
    assert running.after(0, event)["usage"] == {"prompt_tokens": 4, "completion_tokens": 1,
                                                "total_tokens": 5}
    assert running.after(1, event)["usage"]["completion_tokens"] == 1
    final = TokenEvent(Token(1, "a", -1.0), final=FinalInfo("aa", 2, FinishReason.LENGTH, None))
    assert running.after(0, final)["usage"]["completion_tokens"] == 2
    assert vllm_fields.RunningUsage([4], False).after(0, event) == {}
    with pytest.raises(ValidationError, match="needs `stream: true`"):
        vllm_fields.continuous_usage({"stream_options": {"continuous_usage_stats": True}})


def test_unknown_fields_are_logged_once_a_name_and_the_names_remembered_are_bounded(caplog):
    unknown = vllm_fields.UnknownFields("as vLLM does", limit=2)
    with caplog.at_level(logging.WARNING, logger="tgi.router"):
        assert unknown.check({"messages": [], "store": True}, vllm_fields.CHAT_FIELDS, "chat") == \
            ["store"]
        unknown.check({"store": False, "metadata": {}}, vllm_fields.CHAT_FIELDS, "chat")
        unknown.check({"a": 1, "b": 2}, vllm_fields.CHAT_FIELDS, "chat")
    assert [r.getMessage().split("'")[1] for r in caplog.records] == ["store", "metadata"]
    assert "ignored the request field" in caplog.records[0].getMessage()


async def test_the_routes_serve_the_fields(tiny_llama, tmp_path, caplog):
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    client = await _client(_model_with_template(tiny_llama, tmp_path / "m", template),
                           HealthyFake())
    try:
        async def rendered(**fields):
            reply = await client.post("/chat_tokenize", json={"messages": [
                *ASK, {"role": "assistant", "content": "The sky is"}], **fields})
            return reply.status, (await reply.json()).get("templated_text")

        assert await rendered() == (200, "<user>hi</user><assistant>The sky is</assistant>"
                                         "<assistant>")
        assert await rendered(add_generation_prompt=False) == (
            200, "<user>hi</user><assistant>The sky is</assistant>")
        assert await rendered(continue_final_message=True) == (
            200, "<user>hi</user><assistant>The sky is")
        assert (await rendered(continue_final_message=True, add_generation_prompt=True))[0] == 422
        # every chunk carries the usage so far; include_usage adds the last one
        with caplog.at_level(logging.WARNING, logger="tgi.router"):
            reply = await client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 3, "stream": True, "brand_new_field": 1,
                "stream_options": {"continuous_usage_stats": True}})
        chunks = [json.loads(line[6:]) for line in (await reply.text()).splitlines()
                  if line.startswith("data: {")]
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
        assert "brand_new_field" in caplog.text
        reply = await client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "stream": True, "n": 2,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True}})
        chunks = [json.loads(line[6:]) for line in (await reply.text()).splitlines()
                  if line.startswith("data: {")]
        counts = [(c["choices"][0]["index"], c["usage"]["completion_tokens"])
                  for c in chunks if c["choices"]]
        assert sorted(counts) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        for path, body in (("/v1/chat/completions", {"messages": ASK}),
                           ("/v1/completions", {"prompt": "hi"})):
            reply = await client.post(path, json={**body, "guided_regex": "x",
                                                  "response_format": {"type": "json_object"}})
            assert reply.status == 422
            assert "`response_format` and `guided_regex`" in (await reply.json())["error"]
    finally:
        await client.close()
