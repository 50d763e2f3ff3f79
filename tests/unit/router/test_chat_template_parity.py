"""Chat templates render as transformers' apply_chat_template renders them, read from the same
tokenizer_config.json: `{% generation %}` tags, Qwen3's template with enable_thinking and tools,
whitespace control, tojson's arguments, loop controls, namespace and dict, messages' null fields
and reasoning under its other names, the special tokens."""
import json

import pytest

from router.api.openai.request import chat_prompt_parts, normalise_messages
from router.inputs.tool_plan import DEFAULT_TOOL_PROMPT, tool_plan
from router.inputs.chat_template import ChatTemplate


def render_chat(template: ChatTemplate, messages: list[dict], plan, **options) -> str:
    """The prompt a chat request's path makes: its job for the template pool, rendered as a worker
    renders it."""
    job = json.loads(chat_prompt_parts(template, messages, plan, **options).job)
    return ChatTemplate(job["source"]).render_variables(job["variables"])

# Qwen3's template (Qwen/Qwen3-8B's tokenizer_config.json), as users bring it
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# SmolLM3 / OLMo style: the assistant's turns inside transformers' training-mask tags, and
# blocks written without `-`, whose newlines trim_blocks and lstrip_blocks take away
GENERATION = """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'assistant' %}
<|assistant|>
{% generation %}
{{ message.content }}{{ eos_token }}
{% endgeneration %}
    {% else %}
<|{{ message.role }}|>
{{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

# what the environment gives templates: tojson's arguments, loop controls, dict, namespace,
# strftime_now, the special tokens, documents, and messages without their null fields
ENVIRONMENT = """{% set ns = namespace(count=0) %}
{% for m in messages %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{% set ns.count = ns.count + 1 %}
{{ m | tojson(indent=2, separators=(',', ': ')) }}|{{ m | tojson(ensure_ascii=True) }}|{{ m | tojson(sort_keys=True) }}|{{ m | tojson(True) }}
{{ m.keys() | list }}{% if m.name is defined %} named{% endif %}
{% if ns.count == 2 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b=[2]) | tojson }} {{ dict.fromkeys(['x'], 0) }} {{ strftime_now('x%%y') }}
[{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ documents }}|{{ tools | tojson }}]
{% if add_generation_prompt %}>{% endif %}"""

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo 🙂 <b>", "name": None},
        {"role": "assistant", "content": "Hi.", "tool_calls": None},
        {"role": "user", "content": "What is 2+2?"}]
AFTER_A_TOOL = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "thinking": "I should call it.",
                 "tool_calls": [{"type": "function", "function": {
                     "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "{\"celsius\": 21}"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def model_dir(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("templated")
    (directory / "tokenizer.json").write_bytes((tiny_llama / "tokenizer.json").read_bytes())
    return directory


def _both(model_dir, template: str, messages, *, tools=None, **kwargs) -> tuple[str, str]:
    """(ours, transformers') for the same tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "pad_token": "</s>", "chat_template": template}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ChatTemplate.from_model_dir(str(model_dir)).render(
        messages, add_generation_prompt=True, tools=tools, extra=kwargs)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    theirs = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("template,messages,tools,kwargs", [
    (QWEN3, CHAT, None, {}),
    (QWEN3, CHAT, None, {"enable_thinking": False}),
    (QWEN3, AFTER_A_TOOL, [WEATHER], {}),
    (GENERATION, CHAT, None, {}),
    (ENVIRONMENT, CHAT, [WEATHER], {}),
    (ENVIRONMENT, CHAT, None, {"documents": [{"title": "t", "text": "x"}], "bos_token": "[B]"}),
], ids=["qwen3", "qwen3-no-thinking", "qwen3-tools", "generation-tags", "environment",
        "environment-kwargs"])
def test_renders_as_transformers(model_dir, template, messages, tools, kwargs):
    ours, theirs = _both(model_dir, template, messages, tools=tools, **kwargs)
    assert ours == theirs
    assert ours  # each renders something: an empty pair would prove nothing


def test_qwen3_templates_see_the_requests_tools_and_kwargs_as_transformers_gives_them(model_dir):
    """A chat request's path (normalise_messages, render_chat) hands the template what
    apply_chat_template would get from the same OpenAI request."""
    _, theirs = _both(model_dir, QWEN3, CHAT[1:2], tools=[WEATHER], enable_thinking=False)
    # vLLM's way (--tool-call-parser, auto): the template's own words about tools, nothing added
    plan = tool_plan({"tools": [WEATHER]}, parser="hermes", auto_parses=True)
    template = ChatTemplate.from_model_dir(str(model_dir))
    ours = render_chat(template, normalise_messages(CHAT[1:2]), plan,
                       template_kwargs={"enable_thinking": False})
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # TGI's way (a grammar): its tool prompt ends the last message, after the template's tools
    forced = render_chat(template, normalise_messages(CHAT[1:2]), tool_plan({"tools": [WEATHER]}),
                         template_kwargs={"enable_thinking": False})
    asked = CHAT[1]["content"]
    assert forced == theirs.replace(asked, f"{asked}\n---\n{DEFAULT_TOOL_PROMPT}")


def test_the_whole_tool_loop_reaches_qwen3s_template_as_structured_data(model_dir):
    """The call turn (arguments as OpenAI's JSON string), the tool's result and the next question
    render as transformers renders them with the arguments as an object (vLLM parses them)."""
    arguments = {"city": "Paris"}
    request = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": json.dumps(arguments)}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "{\"celsius\": 21}"},
               {"role": "assistant", "content": "It is 21 C."},
               {"role": "user", "content": "And tomorrow?"}]
    given = json.loads(json.dumps(request))
    given[1]["tool_calls"][0]["function"]["arguments"] = arguments
    given[1]["content"] = ""
    _, theirs = _both(model_dir, QWEN3, given, tools=[WEATHER])
    plan = tool_plan({"tools": [WEATHER]}, parser="hermes", auto_parses=True)
    ours = render_chat(ChatTemplate.from_model_dir(str(model_dir)), normalise_messages(request),
                       plan)
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in ours and "<tool_response>\n{\"celsius\": 21}\n</tool_response>" in ours


def test_a_tool_call_turn_is_shown_once_by_a_template_that_reads_tool_calls():
    call = {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    messages = normalise_messages([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"}])
    reads_calls = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}\n"
        "{% endfor %}")
    prompt = render_chat(reads_calls, messages, None)
    # (trim_blocks, as transformers renders, drops the newline after each endfor)
    assert prompt == "user:Weather in Oslo?assistant:<call>weather</call>tool:sunny"
    # a template that never reads tool_calls sees the calls as the turn's text
    plain = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    assert '"name": "weather"' in render_chat(plain, messages, None).splitlines()[1]
