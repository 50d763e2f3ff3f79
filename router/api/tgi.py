"""TGI's native routes: /, /generate, /generate_stream, /tokenize, /health, /info, /metrics."""
from __future__ import annotations

import logging
import time

from aiohttp import web

from router.api import STATE
from router.errors import (BadRequestError, IncompleteGenerationError, RouterError, UnhealthyError,
                           tgi_error_body)
from router.infer import GenerateResult
from router.json_body import parse_json
from router.openapi import openapi_document
from router.request_trace import phase_span, record_phases, request_span
from router.schemas import Timings, Token, TokenEvent
from router.shard_client import ShardError
from router.streaming import open_sse, sse_data
from router.validation import ValidatedGenerate, validate_generate

log = logging.getLogger("tgi.router.api")


def token_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


def prefill_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob}


async def read_json(request: web.Request) -> dict:
    body = parse_json(await request.read())
    if not isinstance(body, dict):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: expected "
                              "an object")
    return body


async def _validate(request: web.Request, body: dict, *, stream: bool) -> ValidatedGenerate:
    state = request.app[STATE]
    state.metrics.counters.inc("tgi_request_count")
    try:
        with phase_span("validation"):
            return await validate_generate(body, state.tokenizer, state.validation_limits,
                                           stream=stream)
    except RouterError as err:
        state.infer.record_failure(err)
        raise


def _sequence_details(result: GenerateResult, *, with_prefill: bool) -> dict:
    final = result.final
    details = {"finish_reason": final.finish_reason.value, "generated_tokens": final.generated_tokens,
               "seed": final.seed}
    if with_prefill:
        details["prefill"] = [prefill_json(t) for t in result.prefill]
    details["tokens"] = [token_json(t) for t in result.tokens]
    if any(result.top_tokens):
        details["top_tokens"] = [[token_json(t) for t in step] for step in result.top_tokens]
    return details


def _timing_headers(state, validated: ValidatedGenerate, timings: Timings, generated: int) -> dict:
    inference = timings.finished_at - timings.batched_at
    ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
    return {
        "x-compute-type": state.compute_type, "x-compute-time": f"{inference:.6f}",
        "x-compute-characters": str(len(validated.request.inputs)),
        "x-total-time": ms(timings.finished_at - timings.started_at),
        "x-validation-time": ms(timings.queued_at - timings.started_at),
        "x-queue-time": ms(timings.batched_at - timings.queued_at),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(inference / max(generated, 1)),
        "x-prompt-tokens": str(validated.request.input_length),
        "x-generated-tokens": str(generated),
    }


async def _generate_payload(request: web.Request, body: dict, *, full_text_default: bool):
    state = request.app[STATE]
    timings = Timings(started_at=time.monotonic())
    validated = await _validate(request, body, stream=False)
    infer = state.infer
    if validated.best_of > 1:
        best, others = await infer.generate_best_of(validated.request, validated.best_of, timings)
    else:
        best, others = await infer.generate(validated.request, timings), []
    prefix = validated.output_prefix(full_text_default)
    payload = {"generated_text": prefix + best.final.text}
    if validated.details or validated.decoder_input_details:
        details = _sequence_details(best, with_prefill=True)
        if others:
            details["best_of_sequences"] = [
                {"generated_text": prefix + r.final.text,
                 **_sequence_details(r, with_prefill=True)} for r in others]
        payload["details"] = details
    record_phases(best.timings)
    headers = _timing_headers(state, validated, best.timings, best.final.generated_tokens)
    return payload, headers


async def generate(request: web.Request) -> web.Response:
    body = await read_json(request)
    with request_span("generate", request.headers):
        payload, headers = await _generate_payload(request, body, full_text_default=False)
    return web.json_response(payload, headers=headers)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    with request_span("generate_stream", request.headers):
        return await _stream(request, body, full_text_default=False)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """POST /: TGI's compatibility route; `stream` picks SSE, else a JSON array of one response."""
    body = await read_json(request)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: stream: "
                              "expected a boolean")
    with request_span("compat_generate", request.headers):
        if stream:
            return await _stream(request, body, full_text_default=True)
        payload, headers = await _generate_payload(request, body, full_text_default=True)
    return web.json_response([payload], headers=headers)


async def _stream(request: web.Request, body: dict, *, full_text_default: bool
                  ) -> web.StreamResponse:
    state = request.app[STATE]
    timings = Timings(started_at=time.monotonic())
    # validation and admission errors answer with their status before the stream opens
    validated = await _validate(request, body, stream=True)
    prefix = validated.output_prefix(full_text_default)
    events = state.infer.stream(validated.request, timings)
    try:
        event = await anext(events, None)
        response = await open_sse(request, {
            "x-compute-type": state.compute_type,
            "x-compute-characters": str(len(validated.request.inputs))})
        index = 0
        try:
            while event is not None:
                index += 1
                await response.write(sse_data(_stream_json(event, index, validated, prefix)))
                if event.final is not None:
                    record_phases(timings)
                    break
                event = await anext(events, None)
            else:
                await response.write(sse_data(tgi_error_body(IncompleteGenerationError(
                    "Incomplete generation stream"))))
        except RouterError as err:
            await response.write(sse_data(tgi_error_body(err)))
        await response.write_eof()
        return response
    finally:
        await events.aclose()


def _stream_json(event: TokenEvent, index: int, validated: ValidatedGenerate, prefix: str) -> dict:
    payload = {"index": index, "token": token_json(event.token), "generated_text": None,
               "details": None}
    if event.top_tokens:
        payload["top_tokens"] = [token_json(t) for t in event.top_tokens]
    if event.final is not None:
        payload["generated_text"] = prefix + event.final.text
        if validated.details:
            payload["details"] = {"finish_reason": event.final.finish_reason.value,
                                  "generated_tokens": event.final.generated_tokens,
                                  "seed": event.final.seed,
                                  "input_length": validated.request.input_length}
    return payload


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: inputs: "
                              "expected a string")
    encoding = state.tokenizer.tokenizer.encode(inputs)
    return web.json_response([
        {"id": i, "text": inputs[start:stop], "start": start, "stop": stop}
        for i, (start, stop) in zip(encoding.ids, encoding.offsets)])


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.batcher.healthy:
        raise UnhealthyError("the model shards are restarting")
    try:
        await state.client.health()
    except ShardError as err:
        log.warning("health check failed: %s", err)
        raise UnhealthyError() from None
    return web.Response(status=200)


async def info(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].info_json())


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/", compat_generate)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api-doc/openapi.json", openapi)
