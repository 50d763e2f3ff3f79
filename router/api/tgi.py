"""TGI's native routes: /generate, /generate_stream, /health, /info, in TGI's schemas."""
from __future__ import annotations

import json
import logging

from aiohttp import web

from router.errors import BadRequestError, RouterError, UnhealthyError, tgi_error_body
from router.infer import GenerateResult
from router.schemas import FinalInfo, Token, TokenEvent
from router.shard_client import ShardError
from router.streaming import open_sse, sse_data
from router.validation import validate_generate

log = logging.getLogger("tgi.router.api")


def token_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


def prefill_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob}


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequestError("Failed to parse the request body as JSON: invalid UTF-8") from None
    except json.JSONDecodeError as err:
        raise BadRequestError(f"Failed to parse the request body as JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object")
    return body


def _details(result: GenerateResult, final: FinalInfo) -> dict:
    details = {
        "finish_reason": final.finish_reason.value,
        "generated_tokens": final.generated_tokens,
        "seed": final.seed,
        "prefill": [prefill_json(t) for t in result.prefill],
        "tokens": [token_json(t) for t in result.tokens],
    }
    if any(result.top_tokens):
        details["top_tokens"] = [[token_json(t) for t in step] for step in result.top_tokens]
    return details


async def generate(request: web.Request) -> web.Response:
    state = request.app["state"]
    body = await read_json(request)
    validated, params = await validate_generate(body, state.tokenizer, state.validation_limits)
    result = await state.infer.generate(validated)
    text = result.final.text
    if params.get("return_full_text"):
        text = validated.inputs + text
    payload = {"generated_text": text}
    if params.get("details") or params.get("decoder_input_details"):
        payload["details"] = _details(result, result.final)
    headers = {"x-prompt-tokens": str(validated.input_length),
               "x-generated-tokens": str(result.final.generated_tokens)}
    return web.json_response(payload, headers=headers)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    state = request.app["state"]
    body = await read_json(request)
    # validation errors answer with their status before the stream opens
    validated, params = await validate_generate(body, state.tokenizer, state.validation_limits,
                                                stream=True)
    events = state.infer.stream(validated)
    first = await _first_event(events)  # 429 and early errors still get a status
    response = await open_sse(request)
    index = 0
    try:
        event = first
        while event is not None:
            index += 1
            await response.write(sse_data(_stream_json(event, index, validated, params)))
            event = await anext(events, None)
    except RouterError as err:
        await response.write(sse_data(tgi_error_body(err)))
    finally:
        await events.aclose()
    await response.write_eof()
    return response


async def _first_event(events) -> TokenEvent | None:
    return await anext(events, None)


def _stream_json(event: TokenEvent, index: int, validated, params: dict) -> dict:
    payload = {"index": index, "token": token_json(event.token), "generated_text": None,
               "details": None}
    if event.top_tokens:
        payload["top_tokens"] = [token_json(t) for t in event.top_tokens]
    if event.final is not None:
        text = event.final.text
        if params.get("return_full_text"):
            text = validated.inputs + text
        payload["generated_text"] = text
        if params.get("details"):
            payload["details"] = {"finish_reason": event.final.finish_reason.value,
                                  "generated_tokens": event.final.generated_tokens,
                                  "seed": event.final.seed,
                                  "input_length": validated.input_length}
    return payload


async def health(request: web.Request) -> web.Response:
    state = request.app["state"]
    try:
        await state.client.health()
    except ShardError as err:
        log.warning("health check failed: %s", err)
        raise UnhealthyError() from None
    return web.Response(status=200)


async def info(request: web.Request) -> web.Response:
    state = request.app["state"]
    return web.json_response(state.info_json())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
