"""The chat route's tool answers over a shard whose text is scripted: calls streamed as OpenAI
streams them and equal to the whole answer, parallel_tool_calls, the no_tool answer cut short,
--tool-call-parser under auto, and tool_choice as TGI's bare function name."""
import json

from router.schemas import FinishReason
from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.unit.router.test_reasoning import ScriptedText

ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TWO_CALLS = ['[{"name":"get_w', 'eather","argu', 'ments":{"city":', '"Paris"}},{"name":"get_time",',
             '"arguments":{}}]']


def _chunks(raw: str) -> list[dict]:
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return [chunk["choices"][0] for chunk in chunks if chunk["choices"]]


async def _both(client, body: dict) -> tuple[dict, list[dict]]:
    """(the whole answer's choice, the stream's choices)."""
    whole = await (await client.post("/v1/chat/completions", json=body)).json()
    assert "choices" in whole, whole
    reply = await client.post("/v1/chat/completions", json={**body, "stream": True})
    return whole["choices"][0], _chunks(await reply.text())


def _joined_calls(choices: list[dict]) -> list[dict]:
    """The calls a stream's deltas add up to, as a client library accumulates them."""
    calls: dict[int, dict] = {}
    for choice in choices:
        for piece in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            if "id" in piece:
                call.update(id=piece["id"], type=piece["type"])
                call["function"]["name"] = piece["function"]["name"]
            call["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


async def test_parallel_calls_stream_name_first_then_arguments_as_the_whole_answer_has_them(
        tiny_llama):
    client = await _client(tiny_llama, ScriptedText(TWO_CALLS), max_total_tokens=2048)
    body = {"messages": ASK, "max_tokens": len(TWO_CALLS), "tools": [WEATHER, TIME],
            "tool_choice": "required", "logprobs": True}
    try:
        whole, stream = await _both(client, body)
        calls = whole["message"]["tool_calls"]
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
        assert len({c["id"] for c in calls}) == 2
        pieces = [(c["delta"]["tool_calls"][0], c) for c in stream if c["delta"].get("tool_calls")]
        first, _ = pieces[0]
        assert first["index"] == 0 and first["type"] == "function" and first["id"]
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        arguments = [p for p, _ in pieces if p["index"] == 0 and "id" not in p]
        assert len(arguments) >= 2 and all(set(p) == {"index", "function"} for p in arguments)
        assert [{k: c[k] for k in ("type", "function")} for c in _joined_calls(stream)] == [
            {k: c[k] for k in ("type", "function")} for c in calls]
        assert stream[-1]["finish_reason"] == "tool_calls"
        streamed_logprobs = [t for c in stream if c["logprobs"] for t in c["logprobs"]["content"]]
        assert streamed_logprobs == whole["logprobs"]["content"]
        # parallel_tool_calls false: one call at most
        one, stream = await _both(client, {**body, "parallel_tool_calls": False})
        assert [c["function"]["name"] for c in one["message"]["tool_calls"]] == ["get_weather"]
        assert [c["function"]["name"] for c in _joined_calls(stream)] == ["get_weather"]
        # TGI's ToolType string: the function's bare name
        named = await client.post("/v1/chat/completions", json={
            **body, "tool_choice": "get_time", "max_tokens": 2})
        assert named.status == 200, await named.text()
        unknown = await client.post("/v1/chat/completions", json={**body, "tool_choice": "nope"})
        assert unknown.status == 422 and "'nope', which is not in `tools`" in await unknown.text()
    finally:
        await client.close()


async def test_an_answer_in_words_cut_by_max_tokens_shows_its_words_never_the_wrapper(tiny_llama):
    pieces = ['{"name":"no_tool","arguments":{"content":"It is', ' sunny \\"to', 'day\\" in']
    client = await _client(tiny_llama, ScriptedText(pieces), max_total_tokens=2048)
    body = {"messages": ASK, "max_tokens": len(pieces), "tools": [WEATHER]}  # auto
    try:
        whole, stream = await _both(client, body)
        assert whole["message"] == {"role": "assistant", "content": 'It is sunny "today" in'}
        assert whole["finish_reason"] == "length"
        said = [c["delta"]["content"] for c in stream]
        assert "".join(s or "" for s in said) == 'It is sunny "today" in'
        assert said[0] == "It is", "the words stream as they are written"
        assert not any("no_tool" in (s or "") for s in said)
    finally:
        await client.close()


HERMES = ["I will check.\n<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
          'ris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>']


async def test_a_tool_call_parser_reads_the_models_own_format_under_auto(tiny_llama):
    client = await _client(tiny_llama, ScriptedText(HERMES), max_total_tokens=2048,
                           tool_call_parser="hermes", enable_auto_tool_choice=True)
    refusing = await _client(tiny_llama, ScriptedText(HERMES), max_total_tokens=2048,
                             tool_call_parser="hermes")
    body = {"messages": ASK, "max_tokens": len(HERMES), "tools": [WEATHER, TIME]}
    try:
        whole, stream = await _both(client, body)
        assert whole["finish_reason"] == "tool_calls"
        assert whole["message"]["content"] == "I will check."
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in whole["message"]["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        assert "".join(c["delta"]["content"] or "" for c in stream) == "I will check."
        assert [c["function"] for c in _joined_calls(stream)] == [
            c["function"] for c in whole["message"]["tool_calls"]]
        assert stream[-1]["finish_reason"] == "tool_calls"
        # vLLM's rule: auto needs --enable-auto-tool-choice once a parser is set
        refused = await refusing.post("/v1/chat/completions", json=body)
        assert refused.status == 422
        assert "--enable-auto-tool-choice" in (await refused.json())["error"]
    finally:
        await client.close()
        await refusing.close()


class EndsWithEos(ScriptedText):
    """The scripted text, its last token the special end-of-sequence one."""

    def _step(self, request_ids, tokens=1):
        generations = super()._step(request_ids, tokens)
        for generation in generations:
            for event in generation.events:
                if event.final is not None:
                    event.token.special = True
                    event.final.finish_reason = FinishReason.EOS_TOKEN
        return generations


async def test_mistrals_special_tag_is_read_and_the_eos_text_left_out(tiny_llama):
    pieces = ["Sure.", "[TOOL_CALLS]", '[{"name": "get_time", "arguments": {}}]', "</s>"]
    client = await _client(tiny_llama, EndsWithEos(pieces), max_total_tokens=2048,
                           tool_call_parser="mistral", enable_auto_tool_choice=True)
    try:
        whole, stream = await _both(client, {"messages": ASK, "max_tokens": len(pieces),
                                             "tools": [TIME]})
        assert whole["message"]["content"] == "Sure." and whole["finish_reason"] == "tool_calls"
        assert [c["function"] for c in whole["message"]["tool_calls"]] == [
            {"name": "get_time", "arguments": "{}"}]
        assert "".join(c["delta"]["content"] or "" for c in stream) == "Sure."
        assert [c["function"] for c in _joined_calls(stream)] == [
            {"name": "get_time", "arguments": "{}"}]
    finally:
        await client.close()


async def test_tgis_function_definition_gives_its_schema_as_arguments(tiny_llama):
    """TGI 2.2.1's FunctionDefinition names the parameters' schema `arguments`: it once went
    unread, and the grammar forced calls with any object as arguments."""
    fake = HealthyFake()
    client = await _client(tiny_llama, fake, max_total_tokens=2048)
    city = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    try:
        for function in ({"name": "get_weather", "arguments": city},
                         {"name": "get_weather", "parameters": city}):  # OpenAI's, TGI's alias
            fake.requests.clear()
            reply = await client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 2, "tool_choice": "required",
                "tools": [{"type": "function", "function": function}]})
            assert reply.status == 200, await reply.text()
            (sent,) = fake.requests.values()
            kind, schema = sent.request.grammar
            calls = json.loads(schema)["items"]
            assert kind == "json" and calls["properties"]["arguments"]["properties"] == {
                "city": {"enum": ["Paris"]}}, schema
    finally:
        await client.close()
