"""The core's fan-out over n requests (Infer.stream_many) and the seed each copy gets."""
from __future__ import annotations

import asyncio

import pytest

from router.core.generation import FanOutStream, Infer
from router.errors import GenerationError
from router.inputs.seeds import SEEDS, copies, seed_or_draw
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Token, TokenEvent)


def _request(seed: int = 7, tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(inputs="hi", input_ids=[1], sampling=SamplingParams(seed=seed),
                           stopping=StoppingParams(max_new_tokens=tokens))


class _ScriptedInfer(Infer):
    """stream() yields each request's tokens ("a", "b", ...) a loop turn apart; a request whose
    seed is in `failing` fails after its first token, one in `held` waits after it."""

    def __init__(self, failing=(), held=(), max_unread_events=0):
        self.failing, self.held = set(failing), set(held)
        self.max_unread_events = max_unread_events  # a pump waits this far ahead of the reader
        self.cancelled: list[int] = []

    async def stream(self, request, timings=None, *, continuation=None):
        seed, count = request.sampling.seed, request.stopping.max_new_tokens
        try:
            for i in range(count):
                await asyncio.sleep(0)
                final = None if i < count - 1 else FinalInfo(
                    "abc"[:count], count, FinishReason.LENGTH, seed)
                yield TokenEvent(Token(i, "abc"[i], -0.1), final=final)
                if seed in self.failing:
                    raise GenerationError("the shard failed")
                if seed in self.held:
                    await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(seed)
            raise


async def _collect(events) -> list[tuple[int, TokenEvent]]:
    return [item async for item in events]


def test_copies_give_each_copy_its_seed_plus_its_index():
    request = _request(seed=SEEDS - 1)
    seeds = [r.sampling.seed for r in copies(request, 3)]
    assert copies(request, 3)[0] is request
    assert seeds == [SEEDS - 1, 0, 1]
    assert seed_or_draw(5) == 5 and 0 <= seed_or_draw(None) < SEEDS


async def test_every_stream_arrives_tagged_with_its_index():
    infer = _ScriptedInfer()
    events = await _collect(infer.stream_many([_request(1), _request(2, tokens=2)]))
    assert sorted(i for i, _ in events) == [0, 0, 0, 1, 1]
    assert [e.final.seed for _, e in events if e.final] in ([1, 2], [2, 1])


async def test_an_aborted_stream_ends_alone_with_what_it_generated():
    infer = _ScriptedInfer(held={2})
    streams = [FanOutStream(), FanOutStream()]
    seen: list[tuple[int, str]] = []

    def on_event(index: int, event: TokenEvent) -> None:
        seen.append((index, event.token.text))
        if index == 1:  # abort the held stream once its first token is in
            streams[1].abort()

    events = await _collect(infer.stream_many([_request(1), _request(2)], streams=streams,
                                              on_event=on_event))
    finals = {i: e.final for i, e in events if e.final is not None}
    assert finals[0].text == "abc" and finals[1].text == "a"
    assert finals[1].finish_reason is FinishReason.LENGTH and finals[1].generated_tokens == 1
    assert streams[1].aborted and not streams[0].aborted and streams[0].finished
    assert seen.count((1, "a")) == 1 and infer.cancelled == [2]


async def test_the_first_error_fails_the_fan_out_and_cancels_the_others():
    infer = _ScriptedInfer(failing={1}, held={2})
    with pytest.raises(GenerationError):
        await _collect(infer.stream_many([_request(1), _request(2)]))
    assert infer.cancelled == [2]
