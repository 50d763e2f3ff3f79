"""TGI's native routes: /, /generate, /generate_stream, /tokenize, /health, /info, /metrics."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from router.core.generation import GenerateResult
from router.api.tgi.errors import tgi_error_body
from router.errors import BadRequestError, RouterError, ValidationError
from router.http.json_body import read_object
from router.http.middleware import ErrorBodies, api_key_middleware, error_middleware
from router.http.sse import StreamFormat, serve_stream, sse_data
from router.inputs.images.placement import markdown_prompt, placed
from router.inputs.images.sources import MediaLimits
from router.inputs.validation import ValidatedGenerate, check_types, validate_generate
from router.lifecycle.served_model import ServedModel
from router.schemas import Timings, Token, TokenEvent
from router.state import MODEL_HEADER, STATE, RouterState, healthy_model, served_model
from router.telemetry.metrics import render_models
from router.telemetry.tracing import phase_span, record_phases, request_span


def token_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


def prefill_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob}


async def validate(served: ServedModel, body: dict, *, stream: bool,
                   media: MediaLimits) -> ValidatedGenerate:
    """TGI's parameters object, validated and counted (shared with the gRPC API).

    `media`: what its images (`![](url)` in the inputs of a model that takes images) may be."""
    with phase_span("validation"):
        return await served.infer.count_request(validate_generate(
            body, served.tokenizer, served.validation_limits, stream=stream,
            adapters=served.adapters, images=served.images, media=media))


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


def _timing_headers(served, validated: ValidatedGenerate, timings: Timings, generated: int) -> dict:
    inference = timings.finished_at - timings.batched_at
    ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
    return {
        "x-compute-type": served.compute_type, "x-compute-time": f"{inference:.6f}",
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
    served = served_model(request)
    timings = Timings(started_at=time.monotonic())
    validated = await validate(served, body, stream=False, media=request.app[STATE].media)
    best, others = await served.infer.generate_best_of(validated.request, validated.best_of,
                                                      timings)
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
    headers = _timing_headers(served, validated, best.timings, best.final.generated_tokens)
    return payload, headers


# Other APIs served at POST /generate (SGLang's native one, router/api/sglang/routes.py) add
# (is_mine(body) -> bool, handler(request, body)) here from their register(); a body with TGI's
# `inputs` is always TGI's. This module never imports them, so no import cycle can form.
GENERATE_DIALECTS = web.AppKey("generate_dialects", list)


async def _neither():
    raise ValidationError("Failed to deserialize the JSON body into the target type: missing field "
                          "`inputs` (TGI's request), or `text`, `input_ids` or `input_embeds` "
                          "(SGLang's)")


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    if "inputs" not in body:
        dialects = request.app.get(GENERATE_DIALECTS, [])
        for is_mine, handler in dialects:
            if is_mine(body):
                return await handler(request, body)
        if dialects:
            await served_model(request).infer.count_request(_neither())
    with request_span("generate", request.headers):
        payload, headers = await _generate_payload(request, body, full_text_default=False)
    return web.json_response(payload, headers=headers)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    with request_span("generate_stream", request.headers):
        return await _stream(request, body, full_text_default=False)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """POST /: TGI's compatibility route; `stream` picks SSE, else a JSON array of one response."""
    body = await read_object(request)
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
    served = served_model(request)
    timings = Timings(started_at=time.monotonic())
    validated = await validate(served, body, stream=True, media=request.app[STATE].media)
    form = TgiStream(validated, validated.output_prefix(full_text_default), timings)
    return await serve_stream(request, served.infer.stream_many([validated.request], timings), form,
                              headers={"x-compute-type": served.compute_type,
                                       "x-compute-characters": str(len(validated.request.inputs))})


class TgiStream(StreamFormat):
    """TGI's StreamResponse per token: `data:{...}`; an error is a last `data:{"error": ...}`."""

    def __init__(self, validated: ValidatedGenerate, prefix: str, timings: Timings):
        self.validated = validated
        self.prefix = prefix
        self.timings = timings
        self.index = 0

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        self.index += 1
        if event.final is not None:
            record_phases(self.timings)
        return [sse_data(_stream_json(event, self.index, self.validated, self.prefix))]

    def error(self, err: RouterError) -> bytes:
        return sse_data(tgi_error_body(err))


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
    served = served_model(request)
    body = await read_object(request)
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequestError("Failed to deserialize the JSON body into the target type: inputs: "
                              "expected a string")
    parameters = body.get("parameters")
    truncate = None
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise BadRequestError("Failed to deserialize the JSON body into the target type: "
                                  "parameters: expected an object")
        truncate = check_types({"truncate": parameters.get("truncate")}).get("truncate")
    text, loaded = inputs, []
    if served.images is not None:  # the tokens the model reads: each image's expanded
        text, loaded = await markdown_prompt(inputs, served.images, request.app[STATE].media,
                                             "`inputs`")
    ids, offsets = await served.tokenizer.encode_offsets_async(text)
    if truncate is not None and truncate < len(ids):  # TGI keeps the last tokens, as /generate
        ids, offsets = ids[len(ids) - truncate:], offsets[len(offsets) - truncate:]
    if loaded:
        placed(ids, served.images, loaded)  # the same 422 as /generate's
    return await tokens_response(text, ids, offsets)


def simple_tokens(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> list[dict]:
    """TGI's SimpleToken list: each id with its span of `text`."""
    return [{"id": i, "text": text[start:stop], "start": start, "stop": stop}
            for i, (start, stop) in zip(ids, offsets)]


_SLICE = 1024  # tokens a json.dumps call


def simple_tokens_json(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> str:
    """simple_tokens(...) as JSON, written a slice at a time.

    json.dumps holds the interpreter for the whole of one call, tens of milliseconds per megabyte,
    and no other thread runs."""
    parts = [json.dumps(simple_tokens(text, ids[start:start + _SLICE],
                                      offsets[start:start + _SLICE]))[1:-1]
             for start in range(0, len(ids), _SLICE)]
    return "[" + ", ".join(parts) + "]"  # json.dumps's own separator


async def tokens_response(text: str, ids: list[int], offsets: list[tuple[int, int]], *,
                          templated_text: str | None = None) -> web.Response:
    """The tokens' JSON answer, made in a worker thread.

    In /chat_tokenize's object when templated_text is given. For a prompt of a megabyte it is tens
    of megabytes, whose building held the event loop (and every other request) for seconds."""
    def build() -> bytes:
        tokens = simple_tokens_json(text, ids, offsets)
        if templated_text is None:
            return tokens.encode()
        return (f'{{"tokenize_response": {tokens}, '
                f'"templated_text": {json.dumps(templated_text)}}}').encode()

    body = await asyncio.to_thread(build)
    return web.Response(body=body, content_type="application/json", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the model X-Model-Id names, else the default model, can serve.

    A 503 (Retry-After) otherwise, as the gRPC health check says NOT_SERVING
    (router/state.py healthy_model). Without the API key the header never reaches here
    (router/http/middleware.py): which models exist is not for those without it."""
    await healthy_model(request.app[STATE], request.headers.get(MODEL_HEADER))
    return web.Response(status=200)


async def info(request: web.Request) -> web.Response:
    return web.json_response(served_model(request).info_json())


async def metrics(request: web.Request) -> web.Response:
    """The named model's metrics, or else every running model's (labelled when several run)."""
    if request.headers.get(MODEL_HEADER) is not None:
        body = served_model(request).metrics.render()
    else:
        body = render_models({name: model.metrics for name, model
                              in request.app[STATE].models.served.items()})
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def metrics_app(state: RouterState) -> web.Application:
    """What --prometheus-port serves: GET /metrics, the same as on the main port.

    With --api-key, X-Model-Id counts only with the key here too."""
    app = web.Application()
    bodies = ErrorBodies(tgi_error_body)
    app.middlewares.append(error_middleware(bodies))
    if state.config.api_key:
        app.middlewares.append(api_key_middleware(state.config.api_key, bodies,
                                                  private_headers=(MODEL_HEADER,)))
    app[STATE] = state
    app.router.add_get("/metrics", metrics)
    return app


def register(app: web.Application) -> None:
    app[GENERATE_DIALECTS] = []
    app.router.add_post("/", compat_generate)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
