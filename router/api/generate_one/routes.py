"""`POST /api/generate-one` and `POST /api/generate-batch`: plain-text answers, and `request_id`
sessions that continue a generation from its cached keys and values.

A call takes its id's session (router/kv/sessions.py) for its duration: the first call generates from
its prompt; a later one ignores its prompt and continues from every token so far, the blocks the
session kept standing in for their prefill. A session is keyed by the caller's API key and the id,
so one client never continues, or reads, another's text. Errors are TGI's `{"error", "error_type"}`,
answered by the error middleware as on every route.
"""
from __future__ import annotations

import asyncio
import hashlib
from contextlib import aclosing

from aiohttp import web

from router.api.generate_one.request import GenerationConfig, Prompt, parse_batch, parse_one
from router.errors import RouterError, ValidationError
from router.http.json_body import read_object
from router.http.sse import StreamFormat, serve_stream
from router.inputs.validation import check_lengths
from router.lifecycle.served_model import ServedModel
from router.schemas import GenerateRequest, StoppingParams, TokenEvent
from router.state import STATE, RouterState, served_model
from router.telemetry.tracing import request_span


class PlainTextStream(StreamFormat):
    """The text itself, chunk by chunk; an error after it started cuts the connection (plain text
    has no way to say it)."""

    def __init__(self, before: str):
        self.before = before
        self.complete = False  # every event was written

    def opening(self) -> list[bytes]:
        return [self.before.encode()] if self.before else []

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        return [event.token.text.encode()] if event.token.text else []

    def closing(self) -> list[bytes]:
        self.complete = True
        return []

    def error(self, err: RouterError) -> None:
        return None


def _who(request: web.Request) -> str:
    """The caller's identity for its sessions: a digest of its credentials ("" without any)."""
    credentials = request.headers.get("Authorization", "")
    return hashlib.sha256(credentials.encode()).hexdigest() if credentials else ""


def _begin(state: ServedModel, request: web.Request, prompt: Prompt):
    """The caller's session of `prompt.request_id`, held for this call (a 409 while another call
    holds it)."""
    return state.begin_session((_who(request), prompt.request_id), prompt.prompt)


async def _request(state: ServedModel, session, config: GenerationConfig) -> GenerateRequest:
    """The core request of one call: the prompt, or on a continuation every token so far, with
    the session's LoRA adapter (its KV blocks were computed with it: a continuation that names
    another is a 422)."""
    # "" names the base model: on a session started with an adapter, that is another adapter
    adapter_id = state.session_adapter(session, config.adapter_id,
                                       named=config.adapter_id is not None)
    if session.started:
        input_ids, inputs = session.token_ids, session.prompt + session.text
        if len(input_ids) > state.limits.max_input_tokens:
            raise ValidationError(
                f"request_id {session.key[1]!r} holds {len(input_ids)} tokens, more than the "
                f"{state.limits.max_input_tokens} a call may start from: it cannot be continued; "
                "start again under a new request_id")
    else:
        input_ids = await state.tokenizer.encode_async(session.prompt,
                                                       max_tokens=state.limits.max_input_tokens)
        inputs = session.prompt
        if not input_ids:
            raise ValidationError("`prompt` cannot be empty")
    max_new_tokens = check_lengths(len(input_ids), config.max_new_tokens, state.limits)
    return GenerateRequest(inputs=inputs, input_ids=list(input_ids), sampling=config.sampling(),
                           stopping=StoppingParams(max_new_tokens=max_new_tokens),
                           num_beams=config.num_beams, length_penalty=config.length_penalty,
                           adapter_id=adapter_id)


def _before(session, only_new_tokens: bool) -> str:
    """What precedes the new text in the answer: nothing, or the prompt and all generated before."""
    return "" if only_new_tokens else session.prompt + session.text


async def _indexed(events):
    async with aclosing(events):
        async for event in events:
            yield 0, event


async def generate_one(request: web.Request) -> web.StreamResponse:
    state = served_model(request)
    with request_span("generate_one", request.headers):
        call = parse_one(await read_object(request), state.generation_defaults)
        session = _begin(state, request, call.prompt)
        succeeded = False  # the session keeps this call's text only once the client has it
        try:
            core = await state.infer.count_request(_request(state, session, call.config))
            before = _before(session, call.only_new_tokens)
            if call.stream_response:
                form = PlainTextStream(before)
                response = await serve_stream(
                    request, _indexed(state.infer.stream(core, session=session)), form,
                    content_type="text/plain; charset=utf-8")
                succeeded = form.complete
                return response
            result = await state.infer.generate(core, session=session)
            succeeded = True
            return web.Response(text=before + result.final.text,
                                content_type="text/plain", charset="utf-8")
        finally:
            state.end_session(session, succeeded)


async def generate_batch(request: web.Request) -> web.Response:
    state = served_model(request)
    with request_span("generate_batch", request.headers):
        call = parse_batch(await read_object(request), state.generation_defaults,
                           state.config.max_client_batch_size)
        sessions = []
        succeeded = False  # every item's, or none's, text joins its session
        try:
            for prompt in call.prompts:
                sessions.append(_begin(state, request, prompt))
            cores = [await state.infer.count_request(_request(state, s, call.config))
                     for s in sessions]
            # read before the run, which adds this call's text to each session
            prompts, earlier = [s.prompt for s in sessions], [s.text for s in sessions]
            # the items run at once inside continuous batching; one failure fails the call
            results = await state.infer.generate_many(cores, sessions=sessions)
            succeeded = True
        finally:
            for session in sessions:
                state.end_session(session, succeeded)
    answers = []
    for item, prompt, before, result in zip(call.prompts, prompts, earlier, results):
        if call.only_new_tokens:
            answers.append({"request_id": item.request_id, "response": result.final.text})
        else:  # the prompt apart, and everything generated for the id so far
            answers.append({"request_id": item.request_id, "prompt": prompt,
                            "response": before + result.final.text})
    return web.json_response(answers)


async def _expire_sessions(state: RouterState) -> None:
    every = max(min(state.models.model_defaults.session_ttl / 4, 5.0), 0.05)
    while True:
        await asyncio.sleep(every)
        for served in list(state.models.served.values()):
            served.expire_sessions()


def register(app: web.Application) -> None:
    state = app[STATE]
    app.router.add_post("/api/generate-one", generate_one)
    app.router.add_post("/api/generate-batch", generate_batch)

    async def start(app):
        state.tasks.append(asyncio.create_task(_expire_sessions(state)))

    app.on_startup.append(start)
