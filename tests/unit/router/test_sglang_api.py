"""SGLang's native /generate and its companion routes, with the real app over a scripted shard.

The fake shard generates tokens 1, 2, 3... ("t1 ", "t2 ", ...) with log-probability -0.5 and
stops at max_new_tokens; conversions and shaping that need other outcomes are tested on their own.
"""
import asyncio
import json

import numpy
import pytest

from router.api.openapi import openapi_document
from router.api.sglang.request import LogprobOptions, SglangItem, is_sglang_body, parse_generate
from router.api.sglang.routes import Run
from router.http.json_out import dumps_in_pieces
from router.errors import ValidationError
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import TokenLimits, ValidationLimits
from router.schemas import FinalInfo, FinishReason, Timings, Token, TokenEvent
from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.waiting import wait_until_async


def _sglang(max_new_tokens=3, **fields):
    return {"text": "hello", "sampling_params": {"max_new_tokens": max_new_tokens}, **fields}


async def test_tgi_and_sglang_share_generate(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        tgi = await client.post("/generate", json={"inputs": "hello",
                                                   "parameters": {"max_new_tokens": 3}})
        assert tgi.status == 200 and (await tgi.json()) == {"generated_text": "t1 t2 t3 "}
        reply = await client.post("/generate", json=_sglang(rid="r1"))
        assert reply.status == 200
        body = await reply.json()
        assert body["text"] == "t1 t2 t3 "
        meta = body["meta_info"]
        assert meta["id"] == "r1" and meta["completion_tokens"] == 3
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] == 0
        assert meta["e2e_latency"] >= 0 and "output_token_logprobs" not in meta
        ebnf = await client.post("/generate", json={"inputs": "a", "parameters": {
            "grammar": {"type": "ebnf", "value": 'root ::= "a"'}}})
        assert ebnf.status == 422, "TGI's grammar types stay json and regex"
        assert "not supported (json, regex, json_schema)" in (await ebnf.json())["error"]
        neither = await client.post("/generate", json={"prompt": "hello"})
        assert neither.status == 422
        error = (await neither.json())["error"]
        assert "missing field `inputs`" in error and "`text`" in error and "`input_ids`" in error
    finally:
        await client.close()


async def test_batches_keep_their_order_and_n_is_batch_major(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json={
            "text": ["a", "b"], "rid": ["x", "y"],
            "sampling_params": [{"max_new_tokens": 1, "n": 2}, {"max_new_tokens": 2, "n": 2}]})
        assert reply.status == 200
        body = await reply.json()
        assert [o["text"] for o in body] == ["t1 ", "t1 ", "t1 t2 ", "t1 t2 "]
        assert [o["meta_info"]["id"] for o in body] == ["x", "x", "y", "y"]
        one = await (await client.post("/generate", json={"input_ids": [1, 2, 3],
                                                          "sampling_params": {"n": 2}})).json()
        assert isinstance(one, list) and len(one) == 2
        assert one[0]["meta_info"]["prompt_tokens"] == 3
        ids = await (await client.post("/generate", json={"input_ids": [[1, 2], [3]]})).json()
        assert [o["meta_info"]["prompt_tokens"] for o in ids] == [2, 1]
        # SGLang's default max_new_tokens (128), within the 128-token context left by the prompt
        assert ids[0]["meta_info"]["completion_tokens"] == 128 - 2
    finally:
        await client.close()


@pytest.mark.parametrize("body,message", [
    ({"text": "a", "input_ids": [1]}, "exactly one of `text`, `input_ids` or `input_embeds`"),
    ({"input_embeds": [[0.1, 0.2]]}, "must be a list of 8 numbers (the model's hidden size)"),
    ({"input_embeds": [[0.1] * 7 + [True]]}, "must hold finite numbers"),
    ({"input_embeds": [[0.1] * 7 + ["1"]]}, "must hold finite numbers"),
    ({"input_embeds": [[0.1] * 7 + [1e39]]}, "must hold finite numbers"),
    ({"input_embeds": []}, "must be a non-empty list of vectors"),
    ({"input_embeds": [[[0.1] * 8], []]}, "`input_embeds[1]` must be a non-empty list"),
    ({"input_embeds": [[0.5] * 8], "return_logprob": True, "logprob_start_len": 0},
     "no token ids to score"),
    ({"text": "a", "image_data": "x.png"}, "takes no images, it reads text only"),
    ({"text": "a", "audio_data": "x.wav"}, "`audio_data` is not supported: this model reads text"),
    ({"text": "a", "custom_logit_processor": "x"}, "serialized Python"),
    ({"text": "a", "token_ids_logprob": [1]}, "needs `return_logprob`"),
    ({"text": "a", "return_logprob": True, "token_ids_logprob": [10**6]}, "is not a token id"),
    ({"text": "a", "return_logprob": True, "token_ids_logprob": 3}, "must be a list"),
    ({"text": ["a", "b"], "return_logprob": True, "token_ids_logprob": [[1]]},
     "1 lists for 2 prompts"),
    ({"text": "a", "return_logprob": True, "token_ids_logprob": [1] * 1025}, "at most 1024"),
    ({"text": "a", "return_hidden_states": "yes"}, "`return_hidden_states` must be a boolean"),
    ({"text": "a", "sampling_params": {"ebnf": "root ::= bar"}}, "Rule 'bar' not found"),
    ({"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a"}}, "only one of"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "only one of"),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "not supported yet"),
    ({"text": "a", "sampling_params": {"json_schema": "{"}}, "not JSON"),
    ({"text": "a", "sampling_params": {"json_schema": "true"}}, "grammar is not valid"),
    ({"text": "a", "sampling_params": {"stop_token_ids": 0}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": 5}},
     "spaces_between_special_tokens"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "-1 (off) or at least 1"),
    ({"text": "a", "sampling_params": {"presence_penalty": 2.5}}, "presence_penalty` must be"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature` must be >= 0"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 2**32}}, "expected u32"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0, "min_new_tokens": 1}},
     "min_new_tokens"),
    ({"text": "a", "sampling_params": {"stream_interval": 0}}, "stream_interval` must be"),
    ({"text": "a", "session_params": {"id": "s"}}, "Send the whole conversation as `text`"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
     "min_new_tokens"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**6]}}, "is not a token id"),
    ({"text": "a", "sampling_params": {"foo": 1}}, "not a field of SGLang's sampling"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "1 objects for 2 prompts"),
    ({"input_ids": [1, -1]}, "expected u32"),
    ({"input_ids": [10**6]}, "is not a token id"),
    ({"text": ""}, "cannot be empty"),
    ({"text": []}, "non-empty list"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ({"text": "a", "stream": "yes"}, "`stream` must be a boolean"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "alike"),
])
async def test_refusals_are_400s_in_sglang_shape(tiny_llama, body, message):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json=body)
        assert reply.status == 400
        error = (await reply.json())["error"]
        assert error["type"] == "validation" and error["code"] == 400
        assert message in error["message"], error["message"]
    finally:
        await client.close()


def _limits():
    return ValidationLimits(TokenLimits(max_input_tokens=64, max_total_tokens=512,
                                        max_batch_prefill_tokens=256), 2, 4, 5)


async def test_conversion_uses_sglangs_defaults(tiny_llama):
    tokenizer = RouterTokenizer(str(tiny_llama))
    batch = await parse_generate({"text": "hello"}, tokenizer, _limits(), 4, 8)
    request = batch.items[0].request
    assert not batch.as_list and request.sampling.do_sample and request.sampling.temperature == 1.0
    assert request.sampling.top_k == 0 and request.stopping.max_new_tokens == 128
    assert request.skip_special_tokens and request.grammar is None
    batch = await parse_generate({"text": "hello", "sampling_params": {
        "temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "repetition_penalty": 1.1, "stop": "x", "stop_token_ids": [7],
        "min_new_tokens": 2, "ignore_eos": True, "skip_special_tokens": False,
        "no_stop_trim": True, "regex": "[ab]+", "max_new_tokens": 9, "sampling_seed": 4}},
        tokenizer, _limits(), 4, 8)
    item = batch.items[0]
    s, st = item.request.sampling, item.request.stopping
    assert not s.do_sample and s.top_k == 5 and s.top_p == 0.5 and s.min_p == pytest.approx(0.1)
    assert (s.frequency_penalty, s.presence_penalty) == (0.5, -0.5) and s.seed == 4
    assert s.repetition_penalty == pytest.approx(1.1)
    assert st.stop_sequences == ["x"] and st.stop_token_ids == [7] and st.min_new_tokens == 2
    assert st.ignore_eos and st.max_new_tokens == 9 and item.no_stop_trim
    assert not item.request.skip_special_tokens and item.request.grammar == ("regex", "[ab]+")
    batch = await parse_generate({"text": "hello", "sampling_params": {
        "json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})}},
        tokenizer, _limits(), 4, 8)
    assert batch.items[0].request.grammar[0] == "json"
    batch = await parse_generate({"text": "hello", "sampling_params": {
        "ebnf": 'root ::= "yes" | "no"'}}, tokenizer, _limits(), 4, 8)
    assert batch.items[0].request.grammar == ("ebnf", 'root ::= "yes" | "no"')
    batch = await parse_generate({"text": ["a", "b"], "return_logprob": [True, False],
                                  "logprob_start_len": [0, -1], "top_logprobs_num": 0},
                                 tokenizer, _limits(), 4, 8)
    first, second = batch.items
    assert first.logprobs.enabled and first.request.prefill_logprobs
    assert not second.logprobs.enabled and not second.request.prefill_logprobs
    assert is_sglang_body({"text": "a"}) and is_sglang_body({"input_ids": [1]}) and is_sglang_body({"input_embeds": []})
    assert not is_sglang_body({"inputs": "a", "text": "b"}) and not is_sglang_body({})
    with pytest.raises(ValidationError, match="exceeds the maximum"):
        await parse_generate({"text": ["a"] * 5}, tokenizer, _limits(), 4, 8)


def _run(events, *, stops=(), no_stop_trim=False, logprobs=LogprobOptions(), max_new_tokens=8):
    from router.schemas import GenerateRequest, SamplingParams, StoppingParams
    request = GenerateRequest("p", [5, 6, 7], SamplingParams(),
                              StoppingParams(max_new_tokens, list(stops)))
    run = Run(SglangItem(request, "rid", logprobs, no_stop_trim), Timings(started_at=0.0))
    for event in events:
        run.record(event)
    return run


def _tokens(*pairs):
    return [TokenEvent(Token(i, text, -0.25)) for i, text in pairs]


def test_stop_string_is_trimmed_unless_no_stop_trim():
    events = _tokens((3, "Hello"), (4, " world"))
    events[-1].final = FinalInfo("Hello world", 2, FinishReason.STOP_SEQUENCE, None)
    assert _run(events, stops=["wor", " world"]).text() == "Hello"
    assert _run(events, stops=[" world"]).finish_reason() == {"type": "stop",
                                                             "matched": " world"}
    assert _run(events, stops=[" world"], no_stop_trim=True).text() == "Hello world"


def test_eos_matches_its_token_id_and_its_text_is_trimmed():
    events = _tokens((3, "Hi"), (2, "</s>"))
    events[-1].final = FinalInfo("Hi</s>", 2, FinishReason.EOS_TOKEN, None)
    run = _run(events)
    assert run.text() == "Hi" and run.finish_reason() == {"type": "stop", "matched": 2}
    assert _run(events, no_stop_trim=True).text() == "Hi</s>"


def test_logprobs_in_sglangs_meta_info_layout():
    events = _tokens((3, "a"), (4, "b"))
    events[0].prefill = [Token(5, "x", None), Token(6, "y", -1.0), Token(7, "z", -2.0)]
    events[0].top_tokens = [Token(3, "a", -0.25), Token(9, "q", -3.0)]
    events[1].top_tokens = [Token(4, "b", -0.25)]
    events[-1].final = FinalInfo("ab", 2, FinishReason.LENGTH, None)
    meta = _run(events, logprobs=LogprobOptions(True, 1, 0, True)).meta_info()
    assert meta["input_token_logprobs"] == [[-1.0, 6, "y"], [-2.0, 7, "z"]]
    assert meta["output_token_logprobs"] == [[-0.25, 3, "a"], [-0.25, 4, "b"]]
    assert "output_top_logprobs" not in meta
    meta = _run(events, logprobs=LogprobOptions(True, 0, 0, False)).meta_info()
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    meta = _run(events, logprobs=LogprobOptions(True, -1, 2, False)).meta_info()
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert meta["output_top_logprobs"] == [[[-0.25, 3, None], [-3.0, 9, None]],
                                           [[-0.25, 4, None]]]


def test_prompt_top_tokens_named_ids_and_hidden_states_in_sglangs_layout():
    events = _tokens((3, "a"), (4, "b"))
    first = events[0]
    first.prefill = [Token(5, "x", None), Token(6, "y", -1.0), Token(7, "z", -2.0)]
    first.prefill_top_tokens = [[], [Token(6, "y", -1.0)], [Token(8, "w", -0.5)]]
    first.prefill_token_ids_logprobs = [[None, None], [-1.5, -2.5], [-3.5, -4.5]]
    first.token_ids_logprobs, events[1].token_ids_logprobs = [-0.1, -0.2], [-0.3, -0.4]
    first.hidden_states = numpy.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], numpy.float32)
    events[1].hidden_states = numpy.array([[6.0, 7.0]], numpy.float32)  # one decode step
    events[-1].final = FinalInfo("ab", 2, FinishReason.LENGTH, None)
    options = LogprobOptions(True, 0, 1, True, [6, 9], ["y", "q"])
    run = _run(events, logprobs=options)
    run.item.return_hidden_states = True
    meta = run.meta_info()
    assert meta["input_top_logprobs"] == [None, [[-1.0, 6, "y"]], [[-0.5, 8, "w"]]]
    assert meta["input_token_ids_logprobs"] == [None, [[-1.5, 6, "y"], [-2.5, 9, "q"]],
                                                [[-3.5, 6, "y"], [-4.5, 9, "q"]]]
    assert meta["output_token_ids_logprobs"] == [[[-0.1, 6, "y"], [-0.2, 9, "q"]],
                                                 [[-0.3, 6, "y"], [-0.4, 9, "q"]]]
    assert json.loads(dumps_in_pieces(meta["hidden_states"])) == [  # the prompt's rows, a step's
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [6.0, 7.0]]
    later = _run(events, logprobs=LogprobOptions(True, 2, 1, False, [6], [None])).meta_info()
    assert later["input_top_logprobs"] == [[[-0.5, 8, None]]]
    assert later["input_token_ids_logprobs"] == [[[-3.5, 6, None]]]
    assert "hidden_states" not in later


async def test_embeddings_named_ids_and_hidden_states_are_parsed(tiny_llama):
    tokenizer = RouterTokenizer(str(tiny_llama))
    rows = [[0.5] * 8, [-1, 2, 0, 0, 0, 0, 0, 3.25]]
    batch = await parse_generate({"input_embeds": rows, "return_hidden_states": True,
                                  "return_logprob": True, "token_ids_logprob": [3, 4],
                                  "return_text_in_logprobs": True}, tokenizer, _limits(), 4, 8)
    item = batch.items[0]
    request = item.request
    assert request.input_ids == [] and request.embeds_rows == 2 and request.input_length == 2
    assert numpy.frombuffer(request.input_embeds, dtype="<f4").tolist() == rows[0] + rows[1]
    assert request.computes_whole_prompt and request.return_hidden_states
    assert item.return_hidden_states and request.logprob_token_ids == [3, 4]
    assert item.logprobs.token_texts == [tokenizer.tokenizer.decode([3]),
                                         tokenizer.tokenizer.decode([4])]
    batch = await parse_generate({"input_embeds": [rows, rows[:1]], "return_logprob": True,
                                  "logprob_start_len": -1,
                                  "token_ids_logprob": [[1], [2, 3]]}, tokenizer, _limits(), 4, 8)
    assert [i.request.embeds_rows for i in batch.items] == [2, 1] and batch.as_list
    assert [i.request.logprob_token_ids for i in batch.items] == [[1], [2, 3]]
    batch = await parse_generate({"text": "hello", "return_logprob": True, "logprob_start_len": 0,
                                  "top_logprobs_num": 2}, tokenizer, _limits(), 4, 8)
    assert batch.items[0].request.prefill_top_n_tokens == 2
    assert batch.items[0].request.prefill_logprobs


async def test_logprobs_through_the_route(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        body = await (await client.post("/generate", json=_sglang(
            max_new_tokens=2, return_logprob=True, return_text_in_logprobs=True))).json()
        assert body["meta_info"]["output_token_logprobs"] == [[-0.5, 1, "t1 "], [-0.5, 2, "t2 "]]
        assert body["meta_info"]["input_token_logprobs"] == []
    finally:
        await client.close()


def _sse(text: str) -> list:
    frames = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


async def test_stream_carries_the_text_so_far_and_ends_like_the_plain_answer(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        plain = await (await client.post("/generate", json=_sglang(rid="a"))).json()
        reply = await client.post("/generate", json=_sglang(stream=True, rid="a"))
        assert reply.status == 200 and reply.headers["Content-Type"] == "text/event-stream"
        frames = _sse(await reply.text())
        assert frames[-1] == "[DONE]"
        assert [f["text"] for f in frames[:-1]] == ["t1 ", "t1 t2 ", "t1 t2 t3 "]
        assert [f["meta_info"]["finish_reason"] for f in frames[:-2]] == [None, None]
        last = frames[-2]
        assert last["text"] == plain["text"]
        assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        reply = await client.post("/generate", json={"text": ["a", "b"], "stream": True,
                                                     "sampling_params": {"max_new_tokens": 2}})
        frames = _sse(await reply.text())
        assert sorted(f["index"] for f in frames[:-1]) == [0, 0, 1, 1]
        bad = await client.post("/generate", json={"text": "a", "stream": True, "lora_path": "x"})
        assert bad.status == 400, "refused before the stream opens, in SGLang's body"
        assert "no LoRA adapters are loaded" in (await bad.json())["error"]["message"]
    finally:
        await client.close()


async def test_stream_error_after_opening_is_an_sglang_frame_then_done(tiny_llama):
    fake = HealthyFake(step_delay=0.01)
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/generate", json=_sglang(max_new_tokens=10, stream=True))
        assert reply.status == 200
        await reply.content.readline()
        fake.fail_next = "decode"
        frames = _sse((await reply.content.read()).decode())
        assert frames[-1] == "[DONE]"
        assert frames[-2]["error"]["type"] == "generation" and frames[-2]["error"]["code"] == 424
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_request_ends_it_with_abort_and_frees_its_blocks(tiny_llama, stream):
    fake = HealthyFake(step_delay=0.02)
    client = await _client(tiny_llama, fake)
    state = client.server.app
    try:
        from router.state import STATE
        allocator = state[STATE].models.default.allocator
        idle = allocator.num_free_blocks
        pending = asyncio.ensure_future(client.post("/generate", json=_sglang(
            max_new_tokens=100, rid="long", stream=stream)))
        for _ in range(500):  # a few tokens in, however slow the machine
            if max(fake.generated.values(), default=0) >= 3:
                break
            await asyncio.sleep(0.01)
        assert allocator.num_free_blocks < idle
        assert (await client.post("/abort_request", json={"rid": "long"})).status == 200
        reply = await asyncio.wait_for(pending, 5)
        assert reply.status == 200
        if stream:
            frames = _sse(await reply.text())
            assert frames[-1] == "[DONE]"
            body = frames[-2]
        else:
            body = await reply.json()
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < body["meta_info"]["completion_tokens"] < 100
        assert body["text"].startswith("t1 t2 ")
        for _ in range(50):
            if allocator.num_free_blocks == idle:
                break
            await asyncio.sleep(0.02)
        assert allocator.num_free_blocks == idle
        assert (await client.post("/abort_request", json={"rid": "gone"})).status == 200
        assert (await client.post("/abort_request", json={"rid": 5})).status == 400
        for body in (b"[1]", b"{"):  # a body not an object, or not JSON: SGLang's 400 too
            refused = await client.post("/abort_request", data=body,
                                        headers={"content-type": "application/json"})
            assert refused.status == 400, await refused.text()
        again = await client.post("/generate", json=_sglang(rid="long"))
        assert again.status == 200, "the rid is free again once its request ended"
    finally:
        await client.close()


async def test_a_running_rid_cannot_be_reused(tiny_llama):
    fake = HealthyFake(step_delay=0.02)
    client = await _client(tiny_llama, fake)
    try:
        first = asyncio.ensure_future(client.post("/generate", json=_sglang(20, rid="same")))
        await wait_until_async(lambda: fake.generated, "the first request to be running")
        second = await client.post("/generate", json=_sglang(rid="same"))
        assert second.status == 400 and "already running" in (await second.json())["error"][
            "message"]
        assert (await first).status == 200
    finally:
        await client.close()


async def test_companion_routes(tiny_llama):
    fake = HealthyFake(step_delay=0.02)
    client = await _client(tiny_llama, fake)
    try:
        assert (await client.get("/health_generate")).status == 200
        info = await (await client.get("/get_model_info")).json()
        assert info["is_generation"] is True and info["tokenizer_path"] == str(tiny_llama)
        server = await (await client.get("/get_server_info")).json()
        assert server["max_total_num_tokens"] > 0 and server["version"]
        assert (await client.post("/flush_cache")).status == 200
        seen = len(fake.generated)  # /health_generate's request
        busy = asyncio.ensure_future(client.post("/generate", json=_sglang(20)))
        await wait_until_async(lambda: len(fake.generated) > seen, "the request to be running")
        reply = await client.post("/flush_cache")
        assert reply.status == 400 and "not be performed" in await reply.text()
        assert (await busy).status == 200
        fake.fail_next = "prefill"
        assert (await client.get("/health_generate")).status == 503
    finally:
        await client.close()


def test_openapi_describes_sglangs_request_and_routes():
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    refs = json.dumps(body)
    assert "GenerateRequest" in refs and "SglangGenerateRequest" in refs
    params = schemas["SglangSamplingParams"]["properties"]
    assert params["top_k"]["minimum"] == -1 and params["max_new_tokens"]["maximum"] == 2**32 - 1
    assert params["presence_penalty"]["maximum"] == 2
    for path in ("/abort_request", "/flush_cache", "/health_generate", "/get_model_info",
                 "/get_server_info"):
        assert path in doc["paths"], path


async def test_flush_cache_lets_go_of_every_cached_block(tiny_llama):
    from router.kv.prefix_cache import PrefixCache
    from router.state import STATE
    client = await _client(tiny_llama, HealthyFake())
    try:
        state = client.server.app[STATE].models.default
        allocator = state.allocator
        cache = PrefixCache(allocator.pool)
        state.batcher.queue.prefix_cache = cache
        state.batcher.running.prefix_cache = cache
        idle = allocator.num_free_blocks
        allocation = allocator.allocate(8)
        cache.insert(list(range(8)), allocation.block_ids)
        allocator.free(allocation)
        assert len(cache) == 2 and allocator.num_free_blocks == idle - 2
        reply = await client.post("/flush_cache")
        assert reply.status == 200 and "Cache flushed" in await reply.text()
        assert len(cache) == 0 and allocator.num_free_blocks == idle
        assert "tgi_kv_cache_prefix_blocks 0.0" in await (await client.get("/metrics")).text()
    finally:
        await client.close()


@pytest.mark.parametrize("body", [
    {"input_ids": [[[1]]]}, {"input_ids": [1, [2]]}, {"input_ids": [[1], []]}, {"input_ids": "ab"},
    {"text": ["a", 5]}, {"text": 5}, {"text": {"a": 1}}, {"text": "a", "rid": 5},
    {"text": "a", "rid": ["a", "b"]}, {"text": ["a", "b"], "rid": "same"},
    {"text": "a", "sampling_params": [1]}, {"text": "a", "sampling_params": "x"},
    {"text": "a", "logprob_start_len": "x"}, {"text": "a", "top_logprobs_num": -1},
    {"text": "a", "return_logprob": "yes"}, {"text": "a", "return_logprob": [True, False]},
    {"text": "a", "sampling_params": {"stop": [1]}}, {"text": "a", "sampling_params": {"n": 0}},
    {"text": "a", "sampling_params": {"stop_token_ids": "x"}},
    {"text": "a", "sampling_params": {"temperature": "hot"}},
    {"text": "a", "sampling_params": {"top_p": 0}}, {"text": "a", "sampling_params": {"min_p": 2}},
    {"text": "a", "sampling_params": {"regex": 5}}, {"text": "a", "sampling_params": {"ebnf": 5}},
    {"text": "a", "sampling_params": {"json_schema": {"type": "object"}}},
    {"text": "a", "sampling_params": {"repetition_penalty": 0}},
    {"text": "a", "sampling_params": {"ignore_eos": 1}},
    {"text": "a", "return_text_in_logprobs": 1}, {"text": "a", "image_data": []},
])
async def test_malformed_sglang_bodies_are_400(tiny_llama, body):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json=body)
        assert reply.status == 400, await reply.text()
        assert (await reply.json())["error"]["message"]
    finally:
        await client.close()


async def test_tokens_arriving_together_still_stream_a_frame_each_as_it_was(tiny_llama):
    """Several tokens a shard call (decode calls of several steps, speculation): each frame holds
    its own token's text so far, count and finish, not the state of the last token recorded."""
    fake = HealthyFake()
    fake.tokens_per_decode = 3
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/generate", json=_sglang(max_new_tokens=7, stream=True))
        frames = _sse(await reply.text())[:-1]
        assert [f["text"] for f in frames] == ["".join(f"t{i} " for i in range(1, n + 1))
                                               for n in range(1, 8)]
        assert [f["meta_info"]["completion_tokens"] for f in frames] == list(range(1, 8))
        assert [f["meta_info"]["finish_reason"] for f in frames[:-1]] == [None] * 6
        assert frames[-1]["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        await client.close()


def test_frames_carry_each_tokens_logprobs_and_hidden_states_once():
    events = _tokens((3, "a"), (4, "b"), (5, "c"))
    first = events[0]
    first.prefill = [Token(5, "x", None), Token(6, "y", -1.0), Token(7, "z", -2.0)]
    first.prefill_top_tokens = [[], [Token(6, "y", -1.0)], [Token(8, "w", -0.5)]]
    first.prefill_token_ids_logprobs = [[None], [-1.5], [-3.5]]
    first.hidden_states = numpy.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], numpy.float32)
    for i, event in enumerate(events):
        event.top_tokens = [Token(event.token.id, event.token.text, -0.25)]
        event.token_ids_logprobs = [-0.1 * (i + 1)]
        if i:
            event.hidden_states = numpy.array([[6.0 + i, 7.0 + i]], numpy.float32)
    events[-1].final = FinalInfo("abc", 3, FinishReason.LENGTH, None)
    whole = _run(events, logprobs=LogprobOptions(True, 0, 1, True, [6], ["y"]))
    whole.item.return_hidden_states = True
    streamed = _run([], logprobs=LogprobOptions(True, 0, 1, True, [6], ["y"]))
    streamed.item.return_hidden_states = True
    streamed.stream_frames(None)
    for event in events:
        streamed.arrived(event)
    frames = [streamed.frame_output(f) for f in streamed.frames]
    assert [f["text"] for f in frames] == ["a", "ab", "abc"]  # the text so far, as SGLang's
    metas = [f["meta_info"] for f in frames]
    assert [len(m["output_token_logprobs"]) for m in metas] == [1, 1, 1]
    assert [len(m["input_token_logprobs"]) for m in metas] == [3, 0, 0]
    assert [len(m["hidden_states"]) for m in metas] == [1, 1, 1]
    expected = whole.meta_info()
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs",
                "hidden_states"):
        listed = json.loads(dumps_in_pieces([x for m in metas for x in m[key]]))
        assert listed == json.loads(dumps_in_pieces(expected[key])), key
    assert [m["completion_tokens"] for m in metas] == [1, 2, 3]
    assert frames[-1]["meta_info"]["finish_reason"] == expected["finish_reason"]


async def test_a_streams_logprobs_grow_linearly_through_the_route(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json=_sglang(
            max_new_tokens=40, stream=True, return_logprob=True, top_logprobs_num=2))
        frames = _sse(await reply.text())[:-1]
        assert [len(f["meta_info"]["output_token_logprobs"]) for f in frames] == [1] * 40
        plain = await (await client.post("/generate", json=_sglang(
            max_new_tokens=40, return_logprob=True, top_logprobs_num=2))).json()
        assert [e for f in frames for e in f["meta_info"]["output_token_logprobs"]] == \
            plain["meta_info"]["output_token_logprobs"]
    finally:
        await client.close()


@pytest.mark.parametrize("options", [{}, {"ensure_ascii": False, "separators": (",", ":")}])
def test_json_in_pieces_is_json_dumps(options):
    from router.http.json_out import dumps_in_pieces

    value = {"text": "café 🙂", "meta_info": {"hidden_states": [[[0.1, 2.5e-8], [3.0, -1.0]],
                                                                [4.0, 5.0]],
                                              "output_top_logprobs": [None, [[-0.5, 3, "a\"b"]]],
                                              "empty": [], "none": None, "n": 3}}
    assert dumps_in_pieces(value, **options) == json.dumps(value, **options)
    assert dumps_in_pieces([value, value], **options) == json.dumps([value, value], **options)


async def test_float32_rows_are_written_exactly_in_few_digits_and_off_the_loop():
    """Hidden states as the shards send them: each value reads back as the same float32, in
    pieces that leave the event loop free, at far fewer bytes than Python floats' digits."""
    from router.http.json_out import dumps
    from tests.loop_gaps import LoopGaps

    rows = numpy.random.default_rng(0).standard_normal((1500, 576), dtype=numpy.float32)
    rows[0, :3] = [float("nan"), 1e-45, -3.4028235e38]
    value = {"text": "é", "meta_info": {"hidden_states": [rows, rows[5]]}}
    async with LoopGaps() as watch:
        text = await dumps(value, numbers=rows.size + 576, ensure_ascii=False,
                           separators=(",", ":"))
    back = json.loads(text)
    assert back["text"] == "é"
    prompt, step = (numpy.array(v, dtype=numpy.float64) for v in back["meta_info"]["hidden_states"])
    assert numpy.isnan(prompt[0, 0]) and numpy.array_equal(prompt[:, 1:].astype(numpy.float32),
                                                           rows[:, 1:])
    assert numpy.array_equal(step.astype(numpy.float32), rows[5])
    assert len(text) < 12 * rows.size, "a float32's digits, not a float64's"
    assert watch.longest < max(0.05, watch.took / 4), (watch.longest, watch.took)
    small = await dumps({"h": [rows[:2, :3]]}, numbers=6)
    assert json.loads(small)["h"][0][1] == [float(x) for x in rows[1, :3].astype(str)]


async def test_a_large_encoding_leaves_the_event_loop_free():
    from router.http.json_out import dumps
    from tests.loop_gaps import LoopGaps

    rows = [[i + j / 1000 for j in range(256)] for i in range(1500)]  # 384,000 numbers
    value = {"text": "", "meta_info": {"hidden_states": [rows]}}
    async with LoopGaps() as watch:
        text = await dumps(value, numbers=len(rows) * 256)
    assert json.loads(text) == value
    # json.dumps of it whole holds the interpreter for the whole encoding
    assert watch.longest < max(0.05, watch.took / 4), (watch.longest, watch.took)
