"""A tool loop (the call turn, the tools' results, the next answer's prompt) through each served
family's own chat template, rendered by a chat request's path and by transformers'
apply_chat_template: Llama 3.1/3.2, Mistral (tekken), Qwen2.5, Qwen3, Gemma 2/3, Phi-3.5,
Phi-4-mini, SmolLM2.

The templates are the models' own (chat_templates/*.jinja, each naming its source on its first
line)."""
import json
from pathlib import Path

import pytest

from router.api.openai.request import normalise_messages, template_messages
from router.inputs.tool_answer import CallReading
from router.inputs.tool_plan import tool_plan
from router.errors import TemplateError
from router.inputs.chat_template import ChatTemplate
from tests.unit.router.test_chat_template_parity import render_chat

TEMPLATES = Path(__file__).parent / "chat_templates"
# each family's special tokens, as its tokenizer_config.json names them
TOKENS = {
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"), "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo": ("<s>", "</s>"), "qwen2.5": (None, "<|im_end|>"), "qwen3": (None, "<|im_end|>"),
    "gemma2": ("<bos>", "<eos>"), "gemma3": ("<bos>", "<eos>"), "phi3.5": ("<s>", "<|endoftext|>"),
    "phi4-mini": ("<|endoftext|>", "<|endoftext|>"),    "smollm2": ("<|im_start|>", "<|im_end|>")}
# the family's --tool-call-parser (vLLM's choice for it)
FAMILY_PARSER = {"llama3.1": "llama3_json", "llama3.2": "llama3_json", "mistral-nemo": "mistral",
           "qwen2.5": "hermes", "qwen3": "hermes", "gemma2": "pythonic", "gemma3": "pythonic",
           "phi3.5": "hermes", "phi4-mini": "hermes", "smollm2": "hermes"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _source(family: str) -> str:
    """The template, without the line naming its source."""
    return (TEMPLATES / f"{family}.jinja").read_text().split("\n", 1)[1]


def _loop(ids: list[str]) -> list[dict]:
    """A tool loop as the OpenAI SDK sends it: the calls' arguments as JSON text, content null,
    one result per call (by its id)."""
    cities, answers = ["Paris", "Oslo"], ['{"celsius": 21}', '{"celsius": 9}']
    calls = [{"id": i, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": c})}} for i, c in zip(ids, cities)]
    return [{"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": i, "content": a} for i, a in zip(ids, answers)]]


def _as_transformers_gets_it(messages: list[dict]) -> list[dict]:
    """The same messages with the calls' arguments as objects, as transformers' templates expect
    them (and vLLM passes them), and a null content as "" (what the router passes: Qwen3's
    template reads `'</think>' in message.content`, which a null fails in transformers too)."""
    given = json.loads(json.dumps(messages))
    for message in given:
        message["content"] = message["content"] or ""
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return given


def _ours(family: str, request: list[dict], tools=(WEATHER,)) -> str:
    bos, eos = TOKENS[family]
    template = ChatTemplate(_source(family), bos_token=bos, eos_token=eos)
    plan = tool_plan({"tools": list(tools)}, parser=FAMILY_PARSER[family], auto_parses=True)
    return render_chat(template, normalise_messages(request), plan)


@pytest.fixture(scope="module")
def transformers_render(tiny_llama, tmp_path_factory):
    """transformers' apply_chat_template of a family's template, from a tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("families")
    (directory / "tokenizer.json").write_bytes((tiny_llama / "tokenizer.json").read_bytes())

    def render(family: str, messages: list[dict], tools=(WEATHER,)) -> str:
        bos, eos = TOKENS[family]
        config = {"chat_template": _source(family), "eos_token": eos, "bos_token": bos}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
        return tokenizer.apply_chat_template(messages, tools=list(tools) or None,
                                             add_generation_prompt=True, tokenize=False)
    return render


OPENAI_IDS = ["call_5f0c6b2e9d1a4c7e8b3f2a10", "call_9a8b7c6d5e4f3a2b1c0d9e8f"]
MISTRAL_IDS = ["a1B2c3D4e", "Z9y8X7w6V"]  # Mistral's: nine letters and digits


@pytest.mark.parametrize("family,ids,shown", [
    ("qwen2.5", OPENAI_IDS, '<tool_response>\n{"celsius": 9}\n</tool_response>'),
    ("qwen3", OPENAI_IDS, '<tool_response>\n{"celsius": 9}\n</tool_response>'),
    ("mistral-nemo", MISTRAL_IDS,
     '[TOOL_RESULTS]{"content": {"celsius": 9}, "call_id": "Z9y8X7w6V"}[/TOOL_RESULTS]'),
])
def test_parallel_calls_and_their_results_render_as_transformers_renders_them(
        transformers_render, family, ids, shown):
    request = _loop(ids)
    ours = _ours(family, request)
    assert ours == transformers_render(family, _as_transformers_gets_it(request))
    assert shown in ours and '"Oslo"' in ours


@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])
def test_llamas_template_takes_one_call_a_turn(transformers_render, family):
    """Llama 3.x's own template renders a turn of one call (the loop, whole, as transformers
    does) and refuses two with its words, which a request answers as a 422 (TGI's and vLLM's
    answer too)."""
    one = _loop(OPENAI_IDS[:1])
    ours = _ours(family, one)
    assert ours == transformers_render(family, _as_transformers_gets_it(one))
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in ours
    assert ours.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"celsius\\": 21}"'
                         '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    with pytest.raises(TemplateError, match="only supports single tool-calls at once"):
        _ours(family, _loop(OPENAI_IDS))
    with pytest.raises(Exception, match="only supports single tool-calls at once"):
        transformers_render(family, _as_transformers_gets_it(_loop(OPENAI_IDS)))


def test_mistrals_template_refuses_call_ids_not_its_own(transformers_render):
    """Mistral's template wants nine-character ids (what --tool-call-parser mistral gives, as
    vLLM's does): OpenAI-style ids are its error, a 422."""
    with pytest.raises(TemplateError, match="length 9"):
        _ours("mistral-nemo", _loop(OPENAI_IDS))
    with pytest.raises(Exception, match="length 9"):
        transformers_render("mistral-nemo", _as_transformers_gets_it(_loop(OPENAI_IDS)))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemmas_template_refuses_the_tool_role_with_its_own_words(transformers_render, family):
    """Gemma's templates know user and model turns only: a tool result is their error (as in
    transformers, TGI and vLLM), which a request answers as a 422 naming it."""
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as refused:
        _ours(family, _loop(OPENAI_IDS))
    assert (refused.value.status, refused.value.error_type) == (422, "template_error")
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        transformers_render(family, _as_transformers_gets_it(_loop(OPENAI_IDS)))


@pytest.mark.parametrize("family,result_shown", [
    ("smollm2", True), ("phi4-mini", True), ("phi3.5", False)])
def test_templates_without_tools_see_the_calls_as_text(transformers_render, family, result_shown):
    """Templates that read neither `tools` nor `tool_calls` get the calls as the turn's text and
    the tools (TGI's way) after the last message; the rest renders as transformers renders the
    same messages. SmolLM2's and Phi-4-mini's (which reads a system message's `tools` text, not
    the variable) show a tool turn as any other; Phi-3.5's drops it, and the tools TGI's way puts
    there with it."""
    request = _loop(OPENAI_IDS)
    ours = _ours(family, request)
    bos, eos = TOKENS[family]
    plan = tool_plan({"tools": [WEATHER]}, parser=FAMILY_PARSER[family], auto_parses=True)
    shaped = template_messages(ChatTemplate(_source(family), bos_token=bos, eos_token=eos),
                               normalise_messages(request), plan)
    assert ours == transformers_render(family, shaped, tools=())
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert calls in ours
    # the results, and the tools after the last of them, are lost with the tool turns
    assert ('{"celsius": 21}' in ours) is result_shown
    assert ('"description": "Current weather"' in ours) is result_shown


@pytest.mark.parametrize("choice,output", [
    ("auto", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),  # the grammar's
])
def test_a_mistral_servers_calls_come_back_through_mistrals_template(transformers_render, choice,
                                                                     output):
    """Under --tool-call-parser mistral, calls (the parser's, and the grammar's under
    `required`) carry ids Mistral's template takes back: the answer's message, sent again with
    the results, renders as transformers renders it."""
    plan = tool_plan({"tools": [WEATHER], "tool_choice": choice}, parser="mistral",
                     auto_parses=True)
    reading = CallReading(plan.reader(), plan.parallel, plan.new_call_id)
    reading.feed(output, last=True)
    answer = reading.message()
    ids = [call["id"] for call in answer["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    request = [_loop(ids)[0], answer, *_loop(ids)[2:]]
    ours = _ours("mistral-nemo", request)
    assert ours == transformers_render("mistral-nemo", _as_transformers_gets_it(request))
    assert f'"call_id": "{ids[1]}"}}[/TOOL_RESULTS]' in ours
    # other parsers' and the grammar's calls without a parser keep OpenAI's kind of id
    for plan in (tool_plan({"tools": [WEATHER], "tool_choice": choice}),
                 tool_plan({"tools": [WEATHER]}, parser="hermes", auto_parses=True)):
        assert plan.new_call_id().startswith("call_")
