"""OpenAI's API on the real SmolLM2 with the real clients: chat (plain, streamed, tools, JSON schema),
completions, models; every body and chunk checked against TGI's OpenAPI schemas."""
import json

import jsonschema
import pytest
import requests

from tests.e2e.server import launch
from tests.openapi_schemas import assert_matches

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    launched = launch([], tmp_path_factory.mktemp("openai"),
                      extra=["--max-input-tokens", "900", "--max-total-tokens", "1024",
                             "--max-batch-prefill-tokens", "1024"])
    yield launched
    assert launched.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def _raw(server, path, body):
    reply = requests.post(f"{server.url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _chunks(server, path, body):
    with requests.post(f"{server.url}{path}", json=body, stream=True, timeout=120) as reply:
        assert reply.status_code == 200, reply.text
        lines = [line[5:].strip() for line in reply.iter_lines(decode_unicode=True)
                 if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_plain_and_streamed_agree(server, client):
    reply = client.chat.completions.create(model="anything", messages=ASK, max_tokens=30,
                                           temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stream = client.chat.completions.create(model="anything", messages=ASK, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    body = {"messages": ASK, "max_tokens": 10, "temperature": 0}
    assert_matches("ChatCompletion", _raw(server, "/v1/chat/completions", body))
    for chunk in _chunks(server, "/v1/chat/completions", {**body, "stream": True}):
        assert_matches("ChatCompletionChunk", chunk)


def test_chat_usage_counts_match_the_tokenizer(server, client, real_model_dir):
    from tokenizers import Tokenizer

    from router.inputs.chat_template import ChatTemplate

    reply = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0)
    prompt = ChatTemplate.from_model_dir(str(real_model_dir)).render(ASK)
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_chat_logprobs_n_seed_and_stop(client):
    reply = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, logprobs=True,
                                           top_logprobs=3, n=2, seed=7, temperature=0.8)
    assert len(reply.choices) == 2
    assert sum(len(c.logprobs.content) for c in reply.choices) == reply.usage.completion_tokens
    for choice in reply.choices:
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in choice.logprobs.content)
    again = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, n=2, seed=7,
                                           temperature=0.8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    free = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0)
    words = free.choices[0].message.content.split()
    stop = words[3]
    stopped = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0,
                                             stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    # as OpenAI does: the text ends where the stop sequence began, without it
    content = stopped.choices[0].message.content
    assert free.choices[0].message.content.startswith(content + stop)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_tool_calls_are_valid_against_the_function_schema(client, tool_choice):
    reply = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=tool_choice, max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:  # parallel_tool_calls: true by default, as OpenAI
        function = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
    if isinstance(tool_choice, dict):  # the function named, called once
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"


def test_tool_choice_auto_and_none(client):
    auto = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=80,
                                          temperature=0)
    message = auto.choices[0].message
    assert message.tool_calls or message.content
    none = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                          tool_choice="none", max_tokens=10, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                            tool_choice="required", max_tokens=80, temperature=0,
                                            stream=True)
    pieces = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces and pieces[0].function.name == "get_weather" and pieces[0].id
    # the name first, then the arguments as they are written
    arguments = "".join(p.function.arguments for p in pieces if p.index == 0)
    assert len([p for p in pieces if p.index == 0]) > 2
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_answers_are_as_our_document_says(server, stream):
    """The answer and each chunk of a call, against the served document's ChatCompletion and
    ChatCompletionChunk (ToolCallMessage, ToolCallDelta, DeltaToolCall)."""
    from tests.openapi_schemas import answer_problems

    doc = requests.get(f"{server.url}/api-doc/openapi.json", timeout=10).json()
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 80,
        "temperature": 0, "stream": stream, "logprobs": True})
    assert reply.status_code == 200, reply.text
    assert "tool_calls" in reply.text
    assert answer_problems(doc, "/v1/chat/completions", "post", reply) == []


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 100000000}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_completions_and_models(server, client):
    single = client.completions.create(model="m", prompt="The capital of France is", max_tokens=5,
                                       temperature=0)
    assert single.choices[0].text.startswith(" Paris")
    several = client.completions.create(model="m", prompt=["One, two,", "A, B,"], max_tokens=4,
                                        temperature=0, echo=True, logprobs=2)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text.startswith("One, two,")
    assert several.choices[0].logprobs.tokens
    streamed = list(client.completions.create(model="m", prompt="The capital of France is",
                                              max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == single.choices[0].text
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert_matches("CompletionFinal", _raw(server, "/v1/completions", body))
    for chunk in _chunks(server, "/v1/completions", {**body, "stream": True}):
        assert_matches("Chunk", chunk)


def test_huggingface_hub_chat_completion(server):
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=server.url)
    reply = hub.chat_completion(messages=ASK, max_tokens=10, temperature=0)
    text = reply.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              hub.chat_completion(messages=ASK, max_tokens=10, temperature=0, stream=True)
              if c.choices]
    assert "".join(pieces) == text
    tools = hub.chat_completion(messages=ASK, tools=[WEATHER], tool_choice="required",
                                max_tokens=80, temperature=0)
    call = tools.choices[0].message.tool_calls[0]
    arguments = call.function.arguments
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments,
                        WEATHER["function"]["parameters"])


def test_text_generation_client_grammar(server):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    client = Client(server.url, timeout=120)
    reply = client.generate("My phone number is ", max_new_tokens=20,
                            grammar=Grammar(type=GrammarType.Regex, value=r"\d{3}-\d{4}"))
    import re

    assert re.fullmatch(r"\d{3}-\d{4}", reply.generated_text)


@pytest.mark.parametrize("body,status,message", [
    ({"messages": []}, 422, "`messages` must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 422, "role must be one of"),
    ({"messages": ASK, "temperature": 3}, 422, "`temperature` must be"),
    ({"messages": ASK, "ignore_eos": "yes"}, 422, "`ignore_eos` must be a boolean"),
    ({"messages": ASK, "min_tokens": 9, "max_tokens": 8}, 422, "`min_tokens` must be <="),
    ({"messages": ASK, "min_tokens": -1}, 422, "`min_tokens` must be >= 0"),
    ({"messages": ASK, "top_logprobs": 3}, 422, "`top_logprobs` needs `logprobs: true`"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
     422, "'nope', which is not in `tools`"),
    ({"messages": ASK, "response_format": {"type": "json_schema",
                                           "json_schema": {"schema": {"type": "nonsense"}}}},
     422, "grammar is not valid"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "what is it?"}]}]},
     422, "takes no images, it reads text only"),
])
def test_chat_validation_errors(server, body, status, message):
    reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == status
    assert message in reply.json()["error"]


def test_completion_suffix_without_fim_tokens_is_a_clear_422(server):
    reply = requests.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "def add(a, b):\n", "suffix": "\n", "max_tokens": 5})
    assert reply.status_code == 422
    assert "fill-in-the-middle" in reply.json()["error"]


def test_the_sdk_reads_why_a_request_is_refused_and_plain_clients_keep_tgi_shape(server, client):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="anything", messages=ASK, max_tokens=5000)
    assert "must be <= 1024" in str(caught.value), "the model's length, in the exception's text"
    assert caught.value.body == {"message": caught.value.body["message"], "code": "validation",
                                 "type": "invalid_request_error", "param": "max_tokens"}
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": ASK, "max_tokens": 5000})
    assert reply.status_code == 422
    assert reply.json() == {"error": caught.value.body["message"], "error_type": "validation"}


def test_vllm_ignore_eos_and_min_tokens_extensions(server, client):
    """Load generators send vLLM's extensions to every OpenAI server: a greedy answer that ends at
    EOS early runs to max_tokens with ignore_eos, and past min_tokens with min_tokens."""
    # a question whose greedy answer ends early whether or not its prefix is cached (a prompt
    # computed in parts multiplies other row counts, which may round otherwise: docs/models.md)
    ask = [{"role": "user", "content": "What is 2+2?"}]
    plain = client.chat.completions.create(model="m", messages=ask, max_tokens=128, temperature=0)
    assert plain.choices[0].finish_reason == "stop"
    early = plain.usage.completion_tokens
    assert early < 120
    forced = client.chat.completions.create(model="m", messages=ask, max_tokens=128,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 128
    assert forced.choices[0].finish_reason == "length"
    at_least = client.chat.completions.create(model="m", messages=ask, max_tokens=128,
                                              temperature=0, extra_body={"min_tokens": early + 5})
    assert at_least.usage.completion_tokens >= early + 5
    legacy = client.completions.create(model="m", prompt="The end.", max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert legacy.usage.completion_tokens == 24


def test_vllm_stop_token_ids_and_min_p(client, real_model_dir):
    """stop_token_ids end the answer at the first of them, as vLLM's do; min_p 1 keeps only the
    likeliest token, so a sampled answer is the greedy one."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompt = "The capital of France is"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    ids = tokenizer.encode(plain.choices[0].text, add_special_tokens=False).ids
    stopped = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 3
    sampled = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.5,
                                        seed=3, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == plain.choices[0].text
    import openai

    with pytest.raises(openai.UnprocessableEntityError, match="is not a token id"):
        client.completions.create(model="m", prompt=prompt, max_tokens=2,
                                  extra_body={"stop_token_ids": [10**9]})


def test_logit_bias_bans_and_forces_tokens(client, real_model_dir):
    import openai
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    prompt = "The capital of France is"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(" Paris")
    paris = tokenizer.encode(" Paris", add_special_tokens=False).ids
    banned = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(i): -100 for i in paris})
    assert "Paris" not in banned.choices[0].text
    (banana,) = tokenizer.encode(" banana", add_special_tokens=False).ids
    forced = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
        temperature=0, logit_bias={str(banana): 100})
    assert forced.choices[0].message.content == " banana" * 4
    # an id past the vocabulary the shards report is the client's mistake
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model="m", prompt=prompt, max_tokens=3,
                                  logit_bias={"49152": 1})
    assert "vocabulary size of 49152" in str(caught.value)  # OpenAI's shape, to the SDK
    assert caught.value.param == "logit_bias"


def test_chat_template_kwargs_are_checked_and_passed(server):
    ok = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
    for kwargs, message in ((["x"], "`chat_template_kwargs` must be an object"),
                            ({"messages": []}, "cannot set 'messages'")):
        reply = requests.post(f"{server.url}/v1/chat/completions", timeout=30,
                              json={"messages": ASK, "chat_template_kwargs": kwargs})
        assert reply.status_code == 422
        assert message in reply.json()["error"]


def test_a_template_that_does_not_compile_leaves_the_other_routes_serving(tiny_llama, tmp_path):
    """The router starts (with --reasoning-parser, forwarded by the launcher), says once why the
    template is broken, serves /generate and answers chat with the template's error."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}\n{% endfor %}{% endif %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    launched = launch(["--model-id", str(model)], tmp_path / "launch",
                      extra=["--reasoning-parser", "think"])
    try:
        generated = requests.post(f"{launched.url}/generate", timeout=60, json={
            "inputs": "The quick", "parameters": {"max_new_tokens": 3}})
        assert generated.status_code == 200, generated.text
        chat = requests.post(f"{launched.url}/v1/chat/completions", timeout=60,
                             json={"messages": ASK, "max_tokens": 3})
        assert chat.status_code == 422
        assert chat.json() == {"error": "Template error: the model's chat template does not "
                                        "compile: Encountered unknown tag 'endif'. (line 2)",
                               "error_type": "template_error"}
    finally:
        assert launched.stop() == 0, launched.log()
    assert launched.log().count("chat template does not compile") == 1
