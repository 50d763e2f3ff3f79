"""Chat templates render in a sandbox; their errors are 422 template errors."""
import pytest

from router.api.openai.request import normalise_messages, render_chat
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
    template = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    messages = normalise_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}])
    text = render_chat(template, messages, [{"name": "get_time", "parameters": {}}])
    assert text.startswith("system:You can call one of these functions")
    assert "get_time" in text and text.endswith("user:ab\n")


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
