"""Tool calling end to end on a tiny model behind Qwen 3's chat template, with --tool-call-parser
hermes and --enable-auto-tool-choice: the openai SDK's streaming helpers on parallel calls, the
OpenAI Agents SDK's tool loop (call, result fed back, final answer), and the loop's turns as the
template renders them."""
import asyncio
import json

import jsonschema
import pytest
import requests

from tests.e2e.server import launch
from tests.tiny_models import build_tiny_model
from tests.unit.router.test_chat_template_parity import QWEN3

pytestmark = pytest.mark.e2e

# enums keep a random model's calls short: each is a few tokens whatever it samples
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("qwen-styled"), max_position_embeddings=4096)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3}))
    launched = launch(["--model-id", str(model)], tmp_path_factory.mktemp("tools"),
                      extra=["--max-input-tokens", "3000", "--max-total-tokens", "3600",
                             "--max-batch-prefill-tokens", "3600",
                             "--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    yield launched
    assert launched.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def test_the_sdks_stream_helper_gets_parallel_calls_piece_by_piece(client):
    options = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                   max_tokens=300, temperature=1.0, seed=3)
    deltas, done = [], []
    with client.chat.completions.stream(**options) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event)
            elif event.type == "tool_calls.function.arguments.done":
                done.append(event)
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (d.name, d.arguments) for d in done]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert len([d for d in deltas if d.name == call.function.name]) >= 2, \
            "the arguments stream in pieces"
    whole = client.chat.completions.create(**options)  # the same seed: the same calls, whole
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
            ] == [(c.function.name, c.function.arguments) for c in calls]
    one = client.chat.completions.create(**{**options, "parallel_tool_calls": False})
    assert len(one.choices[0].message.tool_calls) == 1


def test_an_agents_sdk_tool_loop_runs_end_to_end(server):
    from typing import Literal

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    called = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"21 C and sunny in {city}"

    async def run():
        model = OpenAIChatCompletionsModel(model="m", openai_client=AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused"))
        # the first turn must call (a random model would not choose to); the SDK then resets
        # tool_choice, and under auto the hermes parser finds no call in the model's words
        agent = Agent(name="weather", instructions="Answer with the weather.", model=model,
                      tools=[get_weather], model_settings=ModelSettings(
                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                          max_tokens=64))
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert len(called) == 1 and called[0] in ("Paris", "Oslo")
    fed_back = [i for i in result.to_input_list() if i.get("type") == "function_call_output"]
    assert fed_back and fed_back[0]["output"] == f"21 C and sunny in {called[0]}"
    assert isinstance(result.final_output, str) and result.final_output


def test_the_loops_turns_reach_the_template_as_structured_data(server):
    """The call turn, the tool's result and the next question render as Qwen 3's template writes
    them (/chat_tokenize shows the prompt)."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "user", "content": "And in Oslo?"}]
    reply = requests.post(f"{server.url}/chat_tokenize", json={
        "messages": messages, "tools": [WEATHER]}, timeout=60)
    assert reply.status_code == 200, reply.text
    prompt = reply.json()["templated_text"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("And in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    # TGI's tool_prompt ends the last message, after TGI's separator
    reply = requests.post(f"{server.url}/chat_tokenize", json={
        "messages": messages, "tools": [WEATHER], "tool_prompt": "Use a tool."}, timeout=60)
    assert reply.json()["templated_text"].endswith(
        "And in Oslo?\n---\nUse a tool.<|im_end|>\n<|im_start|>assistant\n")


def test_parallel_calls_and_their_results_come_back_as_transformers_renders_them(server):
    """Two calls in one turn (arguments as the SDK's JSON text) and their two results render as
    transformers renders the same turns with the arguments as objects, and the next answer
    comes from that prompt."""
    from transformers.utils.chat_template_utils import render_jinja_template

    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}
        for i, city in enumerate(["Paris", "Oslo"])]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "21 C"},
                {"role": "tool", "tool_call_id": "call_1", "content": "9 C"}]
    reply = requests.post(f"{server.url}/chat_tokenize", json={
        "messages": messages, "tools": [WEATHER]}, timeout=60)
    assert reply.status_code == 200, reply.text
    given = json.loads(json.dumps(messages))
    given[1]["content"] = ""
    for call in given[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    rendered, _ = render_jinja_template([given], tools=[WEATHER], chat_template=QWEN3,
                                        add_generation_prompt=True)
    assert reply.json()["templated_text"] == rendered[0]
    assert "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n9 C\n</tool_response>" \
        in rendered[0]
    # and the next answer is generated from that prompt
    answer = requests.post(f"{server.url}/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(reply.json()["tokenize_response"])
