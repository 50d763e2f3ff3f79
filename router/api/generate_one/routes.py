"""`POST /api/generate-one` and `POST /api/generate-batch`: plain-text answers over sessions.

A `request_id` session continues a generation from its cached keys and values.

The routes parse the body and format the answer; the served model's sessions
(router/lifecycle/sessions.py) hold a call's sessions, make its requests and keep what they
generated. A session is keyed by the caller's credentials and the id. Errors are TGI's `{"error",
"error_type"}`, answered by the error middleware as on every route.
"""
from __future__ import annotations

import hashlib
from contextlib import aclosing

from aiohttp import web

from router.api.generate_one.request import Prompt, parse_batch, parse_one
from router.errors import RouterError
from router.http.json_body import read_object
from router.http.sse import StreamFormat, serve_stream
from router.schemas import TokenEvent
from router.state import STATE, served_model
from router.telemetry.tracing import request_span


class PlainTextStream(StreamFormat):
    """The text itself, chunk by chunk.

    An error after it started cuts the connection (plain text has no way to say it).
    """

    def __init__(self, before: str):
        self.before = before

    def opening(self) -> list[bytes]:
        return [self.before.encode()] if self.before else []

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        return [event.token.text.encode()] if event.token.text else []

    def error(self, err: RouterError) -> None:
        return None


def _who(request: web.Request) -> str:
    """The caller's identity for its sessions: a digest of its credentials ("" without any)."""
    credentials = request.headers.get("Authorization", "")
    return hashlib.sha256(credentials.encode()).hexdigest() if credentials else ""


def _pairs(prompts: list[Prompt]) -> list[tuple[str, str]]:
    return [(p.request_id, p.prompt) for p in prompts]


async def _indexed(events):
    async with aclosing(events):
        async for event in events:
            yield 0, event


async def generate_one(request: web.Request) -> web.StreamResponse:
    served = served_model(request)
    with request_span("generate_one", request.headers):
        call = parse_one(await read_object(request), served.generation_defaults)
        async with served.sessions.call(_who(request), _pairs([call.prompt]), call.config,
                                        request.app[STATE].media) as held:
            before = held.before(0, only_new_tokens=call.only_new_tokens)
            if call.stream_response:
                return await serve_stream(request, _indexed(held.stream()),
                                          PlainTextStream(before),
                                          content_type="text/plain; charset=utf-8")
            (result,) = await held.generate()
            return web.Response(text=before + result.final.text,
                                content_type="text/plain", charset="utf-8")


async def generate_batch(request: web.Request) -> web.Response:
    served = served_model(request)
    with request_span("generate_batch", request.headers):
        call = parse_batch(await read_object(request), served.generation_defaults,
                           served.config.max_client_batch_size)
        # every item's text, or none's, joins its session
        async with served.sessions.call(_who(request), _pairs(call.prompts), call.config,
                                        request.app[STATE].media) as held:
            # read before the call ends, which adds its text to each session
            prompts, earlier = [s.prompt for s in held.sessions], [s.text for s in held.sessions]
            results = await held.generate()
    answers = []
    for item, prompt, before, result in zip(call.prompts, prompts, earlier, results):
        if call.only_new_tokens:
            answers.append({"request_id": item.request_id, "response": result.final.text})
        else:  # the prompt apart, and everything generated for the id so far
            answers.append({"request_id": item.request_id, "prompt": prompt,
                            "response": before + result.final.text})
    return web.json_response(answers)


def register(app: web.Application) -> None:
    app.router.add_post("/api/generate-one", generate_one)
    app.router.add_post("/api/generate-batch", generate_batch)
