"""The access log with the real app over a scripted shard: one line per request, with its status,
duration, tokens, model, adapter and id; the id answered in x-request-id; a stream's line once it
ends, or once its client went away."""
import asyncio
import logging
import re

import pytest

from router.http.access_log import CLIENT_CLOSED_REQUEST
from tests.unit.router.adapter_helpers import make_adapter_dir
from tests.unit.router.test_api_errors import HealthyFake, _body, _client
from tests.waiting import wait_until_async


@pytest.fixture
def access(caplog):
    """The access log's records so far, as they are made."""
    caplog.set_level(logging.DEBUG, logger="tgi.access")
    return lambda: [r for r in caplog.records if r.name == "tgi.access"]


def _only(records, path):
    found = [r for r in records if r.path == path]
    assert len(found) == 1, [r.getMessage() for r in records]
    return found[0]


async def test_a_generation_is_one_line_with_its_status_duration_tokens_model_and_id(
        tiny_llama, access):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/generate", json=_body(max_new_tokens=3),
                                  headers={"x-request-id": "client-id-7"})
        assert reply.status == 200
        assert reply.headers["x-request-id"] == "client-id-7"
        tokens = (await (await client.post("/tokenize", json={"inputs": "hello"})).json())
    finally:
        await client.close()
    record = _only(access(), "/generate")
    assert (record.method, record.status, record.request_id) == ("POST", 200, "client-id-7")
    assert record.input_tokens == len(tokens) and record.generated_tokens == 3
    assert record.model == tiny_llama.name and not hasattr(record, "adapter")
    assert record.levelno == logging.INFO and record.duration_s > 0
    assert re.fullmatch(rf"POST /generate 200 \d+\.\d{{3}}s input_tokens={len(tokens)} "
                        rf"generated_tokens=3 model={tiny_llama.name} request_id=client-id-7",
                        record.getMessage())
    # a request that generated nothing says no tokens
    assert not hasattr(_only(access(), "/tokenize"), "generated_tokens")


@pytest.mark.parametrize("given", [None, "", "has space", "x" * 129, "tab\there", "é"])
async def test_an_id_is_made_where_the_client_sends_none_or_an_unusable_one(tiny_llama, access,
                                                                           given):
    client = await _client(tiny_llama, HealthyFake())
    try:
        headers = {} if given is None else {"x-request-id": given}
        reply = await client.get("/info", headers=headers)
        made = reply.headers["x-request-id"]
    finally:
        await client.close()
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert _only(access(), "/info").request_id == made


async def test_errors_are_logged_with_their_status_and_answered_with_the_id(tiny_llama, access):
    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    key = {"Authorization": "Bearer s3cret"}
    try:
        refused = await client.post("/generate", json=_body())
        invalid = await client.post("/generate", json={"inputs": ""}, headers=key)
        missing = await client.get("/nowhere", headers=key)
        for reply in (refused, invalid, missing):
            assert re.fullmatch(r"[0-9a-f]{32}", reply.headers["x-request-id"])
    finally:
        await client.close()
    records = access()
    assert [(r.path, r.status) for r in records] == [("/generate", 401), ("/generate", 422),
                                                     ("/nowhere", 404)]
    assert [r.request_id for r in records] == [reply.headers["x-request-id"]
                                               for reply in (refused, invalid, missing)]
    assert all(r.levelno == logging.INFO for r in records)


async def test_a_stream_is_logged_once_when_it_ends(tiny_llama, access):
    client = await _client(tiny_llama, HealthyFake(step_delay=0.02))
    try:
        reply = await client.post("/generate_stream", json=_body(max_new_tokens=5))
        assert reply.status == 200 and reply.headers["x-request-id"]
        await reply.content.readline()
        assert access() == [], "nothing is logged before the stream ends"
        events = (await reply.read()).count(b"data:") + 1
        await wait_until_async(lambda: access(), "the stream's line")
    finally:
        await client.close()
    record = _only(access(), "/generate_stream")
    assert events == 5 and (record.status, record.generated_tokens) == (200, 5)
    assert record.request_id == reply.headers["x-request-id"]
    assert not hasattr(record, "client_gone")


async def _stream_then(tiny_llama, access, then) -> logging.LogRecord:
    """The access record of a stream of up to 60 tokens, `then(reply, fake)` done once its first
    event arrived."""
    fake = HealthyFake(step_delay=0.02)
    client = await _client(tiny_llama, fake)
    try:
        reply = await client.post("/generate_stream", json=_body(max_new_tokens=60))
        await reply.content.readline()
        await then(reply, fake)
        await wait_until_async(lambda: access(), "the stream's line")
    finally:
        await client.close()
    return _only(access(), "/generate_stream")


async def test_a_client_gone_mid_stream_still_gets_its_line(tiny_llama, access):
    async def leave(reply, fake):
        reply.close()  # the connection with it

    record = await _stream_then(tiny_llama, access, leave)
    assert record.status == 200 and record.client_gone is True
    assert 1 <= record.generated_tokens < 60


async def test_an_unanswered_request_whose_client_went_away_is_499(tiny_llama, access):
    fake = HealthyFake(step_delay=0.05)
    client = await _client(tiny_llama, fake)
    try:
        pending = asyncio.ensure_future(client.post("/generate", json=_body(max_new_tokens=60)))
        await wait_until_async(lambda: fake.generated, "the request to be generating")
        pending.cancel()
        await wait_until_async(lambda: access(), "the request's line")
    finally:
        await client.close()
    record = _only(access(), "/generate")
    assert record.status == CLIENT_CLOSED_REQUEST and record.client_gone is True
    assert record.generated_tokens < 60


async def test_an_error_after_the_stream_opened_is_in_its_line(tiny_llama, access):
    async def fail(reply, fake):
        fake.fail_next = "decode"
        await reply.read()

    record = await _stream_then(tiny_llama, access, fail)
    assert (record.status, record.error_type) == (200, "generation")
    assert "error_type=generation" in record.getMessage()


async def test_copies_of_one_prompt_count_its_tokens_once(tiny_llama, access):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/completions", json={"prompt": ["hi", "hello there"],
                                                           "max_tokens": 3, "n": 2})
        usage = (await reply.json())["usage"]
    finally:
        await client.close()
    record = _only(access(), "/v1/completions")
    assert (record.input_tokens, record.generated_tokens) == (usage["prompt_tokens"],
                                                              usage["completion_tokens"])
    assert record.generated_tokens == 2 * 2 * 3


async def test_a_lora_adapter_is_named_beside_its_model(tiny_llama, tmp_path, access):
    client = await _client(tiny_llama, HealthyFake())
    try:
        loaded = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "sql-lora", "lora_path": str(make_adapter_dir(tmp_path, "sql"))})
        assert loaded.status == 200
        reply = await client.post("/v1/chat/completions", json={
            "model": "sql-lora", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status == 200
    finally:
        await client.close()
    record = _only(access(), "/v1/chat/completions")
    assert (record.model, record.adapter) == (tiny_llama.name, "sql-lora")
    assert f"model={tiny_llama.name} adapter=sql-lora" in record.getMessage()


async def test_probes_are_logged_at_debug_unless_they_fail(tiny_llama, access):
    client = await _client(tiny_llama, HealthyFake())
    try:
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()
    assert [(r.path, r.levelno) for r in access()] == [("/health", logging.DEBUG),
                                                       ("/metrics", logging.DEBUG)]


async def test_a_failing_probe_is_logged_at_info(tiny_llama, access):
    from router.shards.client import ShardError

    class SickFake(HealthyFake):
        async def health(self):
            raise ShardError("rank 0 does not answer")

    client = await _client(tiny_llama, SickFake())
    try:
        assert (await client.get("/health")).status == 503
    finally:
        await client.close()
    assert [(r.path, r.status, r.levelno) for r in access()] == [("/health", 503, logging.INFO)]


async def test_a_file_is_logged_with_the_status_it_was_sent_with(tiny_llama, access):
    """A file answer picks 304 (revalidated) or 416 (a range past its end) as it is sent."""
    client = await _client(tiny_llama, HealthyFake())
    try:
        first = await client.get("/ui/app.js")
        modified = first.headers["Last-Modified"]
        again = await client.get("/ui/app.js", headers={"If-Modified-Since": modified})
        past_end = await client.get("/ui/app.js", headers={"Range": "bytes=99999999-"})
    finally:
        await client.close()
    assert (first.status, again.status, past_end.status) == (200, 304, 416)
    assert [r.status for r in access() if r.path == "/ui/app.js"] == [200, 304, 416]
    assert again.headers["x-request-id"] == [r for r in access() if r.status == 304][0].request_id
