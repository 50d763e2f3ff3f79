"""Chat templates render in a sandbox; their errors, compiling included, are 422 template errors
of the chat routes only; chat_template_kwargs become template variables."""
import json

import pytest

from router.api.openai.request import normalise_messages, template_messages
from router.inputs.tool_plan import DEFAULT_TOOL_PROMPT, tool_plan
from router.errors import TemplateError
from router.inputs.chat_template import ChatTemplate


def test_renders_with_tokens_tools_and_generation_prompt():
    template = ChatTemplate("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                            "{% endfor %}{% if tools %}T{{ tools | length }}{% endif %}"
                            "{% if add_generation_prompt %}[assistant]{% endif %}",
                            bos_token="<s>", eos_token="</s>")
    text = template.render([{"role": "user", "content": "hé"}], tools=[{"name": "f"}])
    assert text == "<s>[user]héT1[assistant]"


def test_raise_exception_and_runtime_errors_are_template_errors():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be "
                            "user') }}{% endif %}{{ messages[5].content.upper() }}")
    with pytest.raises(TemplateError, match="first must be user") as err:
        template.render([{"role": "system", "content": "x"}])
    assert err.value.status == 422 and err.value.error_type == "template_error"
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_attribute_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_content_parts_are_joined_and_tools_explained_when_the_template_cannot():
    """As TGI: the tools as JSON and the tool prompt (the request's, or TGI's default) end the last
    message; a template that shows tools itself gets the prompt alone."""
    template = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    messages = normalise_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}])
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    plan = tool_plan({"tools": tools, "tool_choice": "required"})
    text = template.render(template_messages(template, messages, plan))
    assert text == (f"user:ab\n---\n{json.dumps(tools)}\n{DEFAULT_TOOL_PROMPT}\n")
    auto = tool_plan({"tools": tools, "tool_prompt": "Pick one:"})
    text = template.render(template_messages(template, messages, auto))
    assert '"name": "no_tool"' in text and text.endswith("\nPick one:\n")
    shows = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{% endif %}")
    assert shows.render(template_messages(shows, messages, auto)) == "ab\n---\nPick one:"
    # as TGI tells: the template reads the variable; a word in a comment or a message's `tools`
    # field (Phi-4-mini's) does not show the request's tools
    for source in ("{{ messages[0].content }}{# tools #}", "{{ messages[0]['tools'] }}"):
        assert not ChatTemplate(source).knows_tools


def test_suffix_becomes_a_fill_in_the_middle_prompt_when_the_tokenizer_has_its_tokens():
    from types import SimpleNamespace

    from router.api.openai.completions import _with_suffix
    from router.errors import ValidationError

    fim = {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3}
    with_fim = SimpleNamespace(tokenizer=SimpleNamespace(token_to_id=fim.get))
    assert _with_suffix("def f(", ")\n", with_fim) == "<fim_prefix>def f(<fim_suffix>)\n<fim_middle>"
    assert _with_suffix("x", None, with_fim) == "x"
    without = SimpleNamespace(tokenizer=SimpleNamespace(token_to_id=lambda _: None))
    with pytest.raises(ValidationError, match="fill-in-the-middle"):
        _with_suffix("x", "y", without)


def _model_with_template(tiny_llama, directory, template: str):
    """A model directory for the router: the tiny model's tokenizer, `template` its template."""
    import json
    import shutil

    directory.mkdir(exist_ok=True)
    shutil.copy(tiny_llama / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    return directory


BROKEN = "{% for m in messages %}{{ m.content }}\n{% if m.role %}{% endfor %}"
ASK = [{"role": "user", "content": "hi"}]


async def test_a_template_that_does_not_compile_fails_the_chat_routes_only(tiny_llama, tmp_path):
    from tests.unit.router.test_api_errors import HealthyFake, _client

    client = await _client(_model_with_template(tiny_llama, tmp_path / "m", BROKEN), HealthyFake())
    try:
        served = await client.post("/generate", json={"inputs": "hi",
                                                       "parameters": {"max_new_tokens": 2}})
        assert served.status == 200
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                ).status == 200
        for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": ASK, "stream": True}),
                           ("/chat_tokenize", {"messages": ASK}),
                           ("/invocations", {"messages": ASK})):
            reply = await client.post(path, json=body)
            assert reply.status == 422, path
            error = await reply.json()
            assert error["error_type"] == "template_error"
            assert error["error"].startswith("Template error: the model's chat template does not "
                                             "compile: Encountered unknown tag 'endfor'")
            assert error["error"].endswith("(line 2)")
    finally:
        await client.close()


def test_the_router_says_once_at_start_that_the_template_does_not_compile(tiny_llama, tmp_path,
                                                                           caplog):
    from router.config.model import ModelSettings
    from router.lifecycle.served_model import chat_template

    directory = _model_with_template(tiny_llama, tmp_path / "m", BROKEN)
    with caplog.at_level("WARNING", logger="tgi.router"):
        template = chat_template(ModelSettings(tokenizer_path=str(directory), model_id="tiny"))
    assert template.error.endswith("(line 2)")
    (record,) = caplog.records
    assert record.getMessage().startswith("tiny: the model's chat template does not compile")
    assert "the other routes serve" in record.getMessage()


async def test_chat_template_kwargs_become_template_variables(tiny_llama, tmp_path):
    from tests.unit.router.test_api_errors import HealthyFake, _client

    template = ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}<no-think>"
                "{% endif %}{{ style | default('') }}")
    client = await _client(_model_with_template(tiny_llama, tmp_path / "m", template),
                           HealthyFake())
    try:
        async def rendered(kwargs):
            reply = await client.post("/chat_tokenize", json={"messages": ASK,
                                                              "chat_template_kwargs": kwargs})
            return reply.status, (await reply.json()).get("templated_text")

        assert await rendered(None) == (200, "<s>hi")
        assert await rendered({"enable_thinking": False, "style": "!"}) == (200, "<s>hi<no-think>!")
        assert await rendered({"bos_token": "[B]"}) == (200, "[B]hi")  # as in transformers
        chat = await client.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert chat.status == 200
        assert (await chat.json())["usage"]["prompt_tokens"] > \
            (await (await client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 2})).json())["usage"]["prompt_tokens"]
        for kwargs, message in (
                ([1], "`chat_template_kwargs` must be an object"),
                ("enable_thinking", "`chat_template_kwargs` must be an object"),
                ({"messages": []}, "cannot set 'messages'"),
                ({"add_generation_prompt": False}, "cannot set 'add_generation_prompt'"),
                ({"tools": None}, "cannot set 'tools'"),
                ({"chat_template": "{{ 1 }}"}, "cannot set 'chat_template'"),
                ({"documents": ["text"]}, "`chat_template_kwargs.documents` must be a list")):
            for path in ("/chat_tokenize", "/v1/chat/completions"):
                reply = await client.post(path, json={"messages": ASK,
                                                      "chat_template_kwargs": kwargs})
                assert reply.status == 422, (path, kwargs)
                assert message in (await reply.json())["error"]
    finally:
        await client.close()


def test_a_failure_inside_the_template_is_the_requests_422_whatever_its_kind():
    template = ChatTemplate("{% for i in range(n) %}.{% endfor %}{{ 1 / d }}")
    with pytest.raises(TemplateError, match="OverflowError: Range too big"):
        template.render([], extra={"n": 10**12, "d": 1})  # the sandbox's bound on range
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        template.render([], extra={"n": 1, "d": 0})
