"""OpenAI's streams say what the whole answer says: a stop sequence spanning tokens never leaks
into a stream (the scripted shard's tokens are "t1 ", "t2 ", ...)."""
import json

import pytest

from router.inputs.stop_text import StopHoldback, _overlap
from router.schemas import FinalInfo, FinishReason
from tests.unit.router.test_api_errors import HealthyFake, _client


def _streamed_texts(raw: str, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            piece = choice["delta"].get("content") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stop,expected", [
    ([" t3"], "t1 t2"),  # the sequence begins in "t2 " and ends in "t3 "
    (["2 t3 t"], "t1 t"),  # across three tokens
    (["t2 x"], "t1 t2 t3 t4 "),  # begun, never completed: held, then sent
    (["t4 ", " t3"], "t1 t2"),  # the first to complete
])
async def test_streamed_text_equals_the_answers_text(tiny_llama, route, stop, expected):
    chat = route == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 4, "stop": stop, "n": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    client = await _client(tiny_llama, HealthyFake())
    try:
        whole = await (await client.post(path, json=body)).json()
        answers = [c["message"]["content"] if chat else c["text"] for c in whole["choices"]]
        assert answers == [expected, expected]
        reply = await client.post(path, json={**body, "stream": True})
        assert _streamed_texts(await reply.text(), chat) == {0: expected, 1: expected}
    finally:
        await client.close()


def test_the_held_text_is_the_longest_end_that_begins_a_stop_sequence():
    assert _overlap("abcab", "abx") == 2
    assert _overlap("abcab", "b") == 0  # a one-character sequence is whole or absent
    assert _overlap("xaaa", "aaab") == 3
    assert _overlap("", "ab") == 0
    assert _overlap("a" * 50_000, "a" * 49_999 + "b") == 49_999  # linear, not quadratic
    held = StopHoldback(["END", ""])
    assert held.text("the E", None) == "the "
    assert held.text("N", None) == ""
    assert held.text("D", FinalInfo("the END", 3, FinishReason.STOP_SEQUENCE, None)) == ""
    held = StopHoldback(["END"])
    assert held.text("the EN", None) == "the "
    assert held.text("d", FinalInfo("the ENd", 2, FinishReason.LENGTH, None)) == "ENd"
