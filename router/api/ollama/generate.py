"""Ollama's /api/generate and /api/chat: newline-delimited JSON streams by default, or one answer.

Each line of a stream is one object: the text a token adds (`response`, or chat's `message`),
then a last one with `done: true`, the reason and the durations in nanoseconds. An error after
the stream opened is a last line `{"error": "..."}`, as Ollama writes it.
"""
from __future__ import annotations

import json
import time
from contextlib import aclosing
from datetime import datetime, timezone

from aiohttp import web

from router.api.ollama.errors import ollama_error_body
from router.api.ollama.keep_alive import KEEP_ALIVE, model_for, seconds
from router.api.ollama.request import (CHAT_FIELDS, GENERATE_FIELDS, OllamaCall, check_fields,
                                       read_call)
from router.errors import IncompleteGenerationError, RouterError
from router.http.json_body import read_object
from router.http.sse import StreamFormat, serve_stream
from router.inputs.stop_text import StopHoldback
from router.inputs.tool_answer import CallReading
from router.inputs.validation import chosen_adapter
from router.schemas import FinishReason, Timings, TokenEvent
from router.state import STATE

NDJSON = "application/x-ndjson"
_DONE = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
         FinishReason.STOP_SEQUENCE: "stop"}


def created_at() -> str:
    """Now as Ollama writes it: RFC 3339 in UTC, to the microsecond."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class Answer:
    """One answer as its events arrive: the objects a stream writes, and the whole answer's."""

    def __init__(self, call: OllamaCall, model: str, chat: bool, timings: Timings,
                 load_s: float):
        self.call, self.model, self.chat = call, model, chat
        self.timings, self.load_s = timings, load_s
        self.holdback = StopHoldback(call.request.stopping.stop_sequences)
        reader = call.plan.reader()
        self.reading = CallReading(reader, call.plan.parallel) if reader is not None else None
        self.ids: list[int] = []
        self.text = ""
        self.first_at = 0.0
        self.final = None

    def _piece(self, text: str) -> dict:
        out = {"model": self.model, "created_at": created_at()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = False
        return out

    def feed(self, event: TokenEvent) -> list[dict]:
        """The objects this event adds: one with its text (if any), and the last one."""
        if not self.first_at:
            self.first_at = time.monotonic()
        if event.token.id >= 0:
            self.ids.append(event.token.id)
        text = self.holdback.text(event.token.text, event.final)
        if self.reading is not None:
            deltas = self.reading.feed(text, last=event.final is not None)
            text = "".join(d.content for d in deltas if d.index is None)
        self.text += text
        pieces = [self._piece(text)] if text else []
        if event.final is not None:
            self.final = event.final
            pieces.append(self.last(""))
        return pieces

    def last(self, text: str) -> dict:
        """The `done: true` object, with `text` as its response or message."""
        out = self._piece(text)
        now = time.monotonic()
        timings, request = self.timings, self.call.request
        first = self.first_at or now
        if self.chat and self.reading is not None and self.reading.calls:
            out["message"]["tool_calls"] = [
                {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in self.reading.calls]
        out.update(done=True, done_reason=_DONE[self.final.finish_reason],
                   total_duration=_ns(now - timings.started_at + self.load_s),
                   load_duration=_ns(self.load_s),
                   prompt_eval_count=request.input_length,
                   prompt_eval_duration=_ns(first - (timings.batched_at or first)),
                   eval_count=self.final.generated_tokens, eval_duration=_ns(now - first))
        if not self.chat:
            out["context"] = self.call.context + self.ids
        return out


def _arguments(text: str):
    """A call's arguments as the object Ollama gives (the JSON text if it is not an object)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return text
    return value


class NdjsonStream(StreamFormat):
    """Ollama's stream: one JSON object a line."""

    def __init__(self, answer: Answer):
        self.answer = answer

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        return [_line(obj) for obj in self.answer.feed(event)]

    def error(self, err: RouterError) -> bytes:
        return _line(ollama_error_body(err))


async def _answer(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await read_object(request)
    route = "/api/chat" if chat else "/api/generate"
    check_fields(body, CHAT_FIELDS if chat else GENERATE_FIELDS, route)
    keep = seconds(body.get("keep_alive"))
    served, adapter_id = await model_for(request, body.get("model"))
    state, alive = request.app[STATE], request.app[KEEP_ALIVE]
    model = body.get("model") or served.model_name
    load_s = alive.loading.pop(served.model_name, 0.0)
    empty = not (body.get("messages") if chat else body.get("prompt") or body.get("images"))
    if empty:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        alive.touch(state, served.model_name, keep)
        reason = "unload" if keep == 0 else "load"
        out = {"model": model, "created_at": created_at(), "done": True, "done_reason": reason}
        out["message" if chat else "response"] = ({"role": "assistant", "content": ""}
                                                  if chat else "")
        return web.json_response(out)
    timings = Timings(started_at=time.monotonic())
    chosen_adapter(adapter_id, served.adapters)
    call = await served.infer.count_request(read_call(request, served, body, chat=chat,
                                                      adapter_id=adapter_id))
    alive.touch(state, served.model_name, keep)
    answer = Answer(call, model, chat, timings, load_s)
    events = served.infer.stream_many([call.request], timings)
    try:
        if call.stream:
            return await serve_stream(request, events, NdjsonStream(answer),
                                      content_type=NDJSON)
        async with aclosing(events):
            async for _, event in events:
                answer.feed(event)
    finally:
        alive.touch(state, served.model_name, keep)  # its time counts from the request's end
    if answer.final is None:
        raise IncompleteGenerationError()
    return web.json_response(answer.last(answer.text))


async def generate(request: web.Request) -> web.StreamResponse:
    return await _answer(request, chat=False)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _answer(request, chat=True)
