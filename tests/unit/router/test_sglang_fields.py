"""SGLang's habits on /generate: unknown fields ignored, 400s, prompt scoring and stream_interval.

Through the real app over the scripted shard of test_sglang_api (tokens "t1 ", "t2 ", ...)."""
import logging

from router.api.sglang import request as sglang_request
from router.api.sglang.request import LogprobOptions, SglangItem
from router.api.sglang.routes import Run
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Timings, Token, TokenEvent)
from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.unit.router.test_sglang_api import _sse


def test_an_unknown_fields_name_is_remembered_cut_short():
    """A thousand bodies, each with a megabyte-long field name, once kept a gigabyte."""
    name = "n" * 1_000_000
    try:
        sglang_request.check_fields({"text": "a", name: 1})
        assert name not in sglang_request.UNKNOWN.warned and name[:100] in sglang_request.UNKNOWN.warned
    finally:
        sglang_request.UNKNOWN.warned.discard(name[:100])


async def test_unknown_top_level_fields_are_ignored_and_logged_once(tiny_llama, caplog):
    client = await _client(tiny_llama, HealthyFake())
    sglang_request.UNKNOWN.warned.discard("newer_field")
    try:
        with caplog.at_level(logging.WARNING, logger="tgi.router"):
            for _ in range(2):
                reply = await client.post("/generate", json={
                    "text": "a", "newer_field": {"x": 1}, "sampling_params": {"max_new_tokens": 2}})
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["text"] == "t1 t2 "
        warned = [r for r in caplog.records if "newer_field" in r.getMessage()]
        assert len(warned) == 1, "once per field name"
        # a field of SGLang's asking for what this server does not compute: refused when true
        asked = await client.post("/generate", json={"text": "a", "return_entropy": True})
        assert asked.status == 400 and "`return_entropy`" in (await asked.json())["error"][
            "message"]
        assert (await client.post("/generate", json={
            "text": "a", "return_entropy": False, "sampling_params": {"max_new_tokens": 1}})
                ).status == 200
        # SGLang's SamplingParams is a closed struct: an unknown key is refused there too
        bad = await client.post("/generate", json={"text": "a", "sampling_params": {"foo": 1}})
        assert bad.status == 400 and "`sampling_params.foo`" in (await bad.json())["error"][
            "message"]
    finally:
        await client.close()


async def test_max_new_tokens_zero_answers_no_output_tokens(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = {"text": "hello", "return_logprob": True,
                "sampling_params": {"max_new_tokens": 0, "stop": ["t1"]}}
        out = await (await client.post("/generate", json=body)).json()
        meta = out["meta_info"]
        assert out["text"] == "" and meta["completion_tokens"] == 0
        assert meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        frames = _sse(await (await client.post("/generate", json={**body, "stream": True})).text())
        assert frames[-1] == "[DONE]" and len(frames) == 2
        assert frames[0]["text"] == "" and frames[0]["meta_info"]["finish_reason"]["length"] == 0
    finally:
        await client.close()


def _item(**fields) -> SglangItem:
    request = GenerateRequest("p", [5, 6, 7], SamplingParams(), StoppingParams(8, []))
    return SglangItem(request, "rid", LogprobOptions(True, 0, 0, False), False, **fields)


def test_a_scored_prompt_keeps_its_logprobs_and_leaves_the_sampled_token_out():
    run = Run(_item(score_only=True), Timings(started_at=0.0))
    event = TokenEvent(Token(9, "q", -0.5), prefill=[Token(5, "x", None), Token(6, "y", -1.0)],
                       final=FinalInfo("q", 1, FinishReason.LENGTH, None))
    run.record(event)
    meta = run.meta_info()
    assert run.text() == "" and meta["completion_tokens"] == 0
    assert meta["input_token_logprobs"] == [[None, 5, None], [-1.0, 6, None]]
    assert meta["output_token_logprobs"] == []


def test_stream_interval_frames_every_n_tokens_and_the_last():
    run = Run(_item(stream_interval=2), Timings(started_at=0.0))
    run.stream_frames(None)
    events = [TokenEvent(Token(i, f"t{i} ", -0.5)) for i in range(1, 6)]
    events[0].prefill = [Token(5, "x", None), Token(6, "y", -1.0)]
    events[-1].final = FinalInfo("t1 t2 t3 t4 t5 ", 5, FinishReason.LENGTH, None)
    for event in events:
        run.arrived(event)
    frames = [run.frame_output(f) for f in run.frames if f is not None]
    assert [f["text"] for f in frames] == ["t1 t2 ", "t1 t2 t3 t4 ", "t1 t2 t3 t4 t5 "]
    assert [len(f["meta_info"]["output_token_logprobs"]) for f in frames] == [2, 2, 1]
    assert [len(f["meta_info"]["input_token_logprobs"]) for f in frames] == [2, 0, 0]
    assert sum(f is None for f in run.frames) == 2, "an event between frames sends nothing"
