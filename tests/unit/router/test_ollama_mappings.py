"""Ollama's options, keep_alive durations and answers mapped onto the router's requests and events."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from router.api.ollama.generate import Answer
from router.api.ollama.keep_alive import KeepAlive, seconds, stop_idle
from router.api.ollama.options import read_options, token_budget
from router.api.ollama.request import OllamaCall
from router.errors import ValidationError
from router.inputs.tool_plan import tool_plan
from router.inputs.validation import TokenLimits, ValidationLimits
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Timings, Token, TokenEvent)
from tests.waiting import wait_until_async

LIMITS = ValidationLimits(TokenLimits(100, 128, 128), max_best_of=2, max_stop_sequences=4,
                          max_top_n_tokens=5, vocab_size=50)


def test_options_take_ollamas_defaults_and_map_each_sampler():
    default = read_options(None, LIMITS)
    assert (default.sampling.temperature, default.sampling.top_k, default.sampling.top_p,
            default.sampling.repetition_penalty) == pytest.approx((0.8, 40, 0.9, 1.1))
    assert default.sampling.do_sample and default.num_predict is None and default.stop == []
    given = read_options({"temperature": 0, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "seed": 7,
                          "num_predict": 9, "stop": ["x", ""], "repeat_penalty": 1.3,
                          "presence_penalty": 0.5, "frequency_penalty": -0.5, "num_ctx": 64,
                          "mirostat": 0, "repeat_last_n": -1}, LIMITS)
    s = given.sampling
    assert not s.do_sample and (s.top_k, s.seed) == (3, 7)
    assert (s.top_p, s.min_p) == pytest.approx((0.5, 0.1))
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx(
        (1.3, 0.5, -0.5))
    assert given.stop == ["x"] and given.num_predict == 9 and given.num_ctx == 64
    assert read_options({"num_predict": -1, "seed": -1}, LIMITS).num_predict is None


@pytest.mark.parametrize("options, words", [
    ({"mirostat": 2}, "no such sampler"), ({"num_gpu": 1}, "when it starts"),
    ({"bogus": 1}, "`bogus` is not supported"), ({"num_ctx": 4096}, "--max-total-tokens"),
    ({"temperature": "hot"}, "options.temperature"), ({"num_predict": 0}, "positive"),
    ({"stop": ["a"] * 5}, "up to 4"), ([], "must be an object")])
def test_options_that_cannot_be_served_are_refused_with_the_reason(options, words):
    with pytest.raises(ValidationError) as raised:
        read_options(options, LIMITS)
    assert words in str(raised.value)


def test_the_token_budget_is_what_num_predict_and_num_ctx_leave():
    assert token_budget(read_options({}, LIMITS), 28, LIMITS) == 100
    assert token_budget(read_options({"num_predict": 5}, LIMITS), 28, LIMITS) == 5
    assert token_budget(read_options({"num_ctx": 40}, LIMITS), 28, LIMITS) == 12
    with pytest.raises(ValidationError, match="prompt is 40 tokens"):
        token_budget(read_options({"num_ctx": 40}, LIMITS), 40, LIMITS)


@pytest.mark.parametrize("value, expected", [
    (None, None), (0, 0.0), ("0", 0.0), (30, 30.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("-1", -1.0), (-1, -1.0), ("1.5s", 1.5), ("250ms", 0.25)])
def test_keep_alive_reads_seconds_and_go_durations(value, expected):
    assert seconds(value) == expected


@pytest.mark.parametrize("value", ["5 minutes", "m", True, [], "5x"])
def test_keep_alive_refuses_what_is_no_duration(value):
    with pytest.raises(ValidationError, match="keep_alive"):
        seconds(value)


def _call(stop=(), plan=None, context=None) -> OllamaCall:
    request = GenerateRequest(inputs="p", input_ids=[1, 2, 3], sampling=SamplingParams(),
                              stopping=StoppingParams(max_new_tokens=8,
                                                      stop_sequences=list(stop)))
    return OllamaCall(request, True, plan or tool_plan({}), context)


def _events(texts: list[str], reason=FinishReason.EOS_TOKEN) -> list[TokenEvent]:
    events = [TokenEvent(Token(10 + i, t, -0.1)) for i, t in enumerate(texts)]
    events[-1].final = FinalInfo("".join(texts), len(texts), reason, None)
    return events


def test_a_generate_answer_streams_text_without_its_stop_and_ends_with_durations():
    answer = Answer(_call(stop=["END"], context=[1, 2, 3]), "m", False,
                    Timings(started_at=0.0), 0.0)
    lines = [o for e in _events(["Hel", "lo E", "ND"], FinishReason.STOP_SEQUENCE)
             for o in answer.feed(e)]
    assert "".join(o["response"] for o in lines) == "Hello "
    last = lines[-1]
    assert last["done"] and last["done_reason"] == "stop" and last["eval_count"] == 3
    assert last["context"] == [1, 2, 3, 10, 11, 12] and last["prompt_eval_count"] == 3
    assert all(isinstance(last[k], int) for k in ("total_duration", "eval_duration"))
    assert not any(o["done"] for o in lines[:-1])


def test_a_chat_answer_gives_tool_calls_with_object_arguments():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    answer = Answer(_call(plan=tool_plan({"tools": tools})), "m", True, Timings(), 0.0)
    text = json.dumps([{"name": "f", "arguments": {"a": 1}}])
    lines = [o for e in _events([text[:7], text[7:]], FinishReason.LENGTH)
             for o in answer.feed(e)]
    last = lines[-1]
    assert last["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
    assert last["done_reason"] == "length" and "context" not in last


def test_a_model_past_its_keep_alive_stops_only_once_idle():
    stopped = []

    class Models:
        registry = SimpleNamespace(records={"m": object()})
        served = {"m": SimpleNamespace(infer=SimpleNamespace(is_idle=False))}

        async def stop(self, model_id):
            stopped.append(model_id)
            del self.served[model_id]

    state = SimpleNamespace(models=Models())
    keep = KeepAlive()
    keep.touch(state, "m", 0)
    assert keep.expires_at("m") is not None

    async def scenario():
        task = asyncio.create_task(stop_idle(state, keep, interval=0.001))
        await asyncio.sleep(0.02)
        assert stopped == []  # a request of it is in flight
        state.models.served["m"].infer.is_idle = True
        await wait_until_async(lambda: stopped == ["m"], "the idle model stopped")
        task.cancel()

    asyncio.run(scenario())
    keep.touch(state, "m", -1)  # for ever: no deadline
    assert keep.expires_at("m") is None
    with pytest.raises(ValidationError, match="without a registry id"):
        keep.touch(state, "unrecorded", 60)
    keep.touch(state, "unrecorded", None)  # not given: nothing to keep
