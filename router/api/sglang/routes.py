"""SGLang's native API: POST /generate and its companion routes.

`POST /generate` takes `text` / `input_ids`; the companion routes are /abort_request, /flush_cache,
/health_generate, /get_model_info and /get_server_info.

TGI and SGLang share the path `POST /generate`. TGI's module owns the route and keeps a short list
of other dialects (`tgi.GENERATE_DIALECTS`); `register` adds SGLang's (`is_sglang_body`, `generate`) to it.
A body with `inputs` is TGI's, one with `text`, `input_ids` or `input_embeds` is SGLang's, and one
with neither gets TGI's 422 naming both. This module imports `tgi` for the key and `tgi` imports
nothing of it, so the dependency runs one way and TGI's handler stays as it was for TGI bodies.

The body becomes one GenerateRequest per prompt and copy (router/api/sglang/request.py); each runs
through the core as its own stream. A request's `rid` stays in a registry while it runs, so that
`POST /abort_request` can cancel it: its stream is closed (the core frees its KV blocks) and its
answer says `finish_reason: {"type": "abort"}` with what it had generated.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from router import VERSION
from router.api.sglang.lora import SglangBadRequest
from router.api.sglang.request import is_sglang_body, parse_generate
from router.api.sglang.run import Run
from router.api.tgi import routes as tgi
from router.api.sglang.errors import sglang_error_body
from router.errors import (BadRequestError, OverloadedError, RouterError, UnhealthyError,
                           ValidationError)
from router.http.middleware import ERROR_BODY
from router.http.json_body import read_object
from router.http.json_out import STREAM_JSON, dumps
from router.http.sse import StreamFormat, openai_sse, serve_stream
from router.schemas import GenerateRequest, SamplingParams, StoppingParams, Timings, TokenEvent
from router.state import MODEL_HEADER, STATE, healthy_model, served_model
from router.telemetry.tracing import request_span

# rid -> the runs that carry it (n copies of one prompt share their rid)
RUNNING = web.AppKey("sglang_running", dict)


def _events(infer, runs: list[Run]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(index, event) of every run as they arrive.

    Through the core's fan-out (each run abortable alone; an aborted run ends with an event of its
    own)."""
    return infer.stream_many([run.request for run in runs], streams=[run.stream for run in runs],
                             on_event=lambda index, event: runs[index].arrived(event))


class SglangStream(StreamFormat):
    """SGLang's stream: a `data:` frame per token, `data: [DONE]` at the end.

    Each frame is `data: {"text": <text so far>, "meta_info": {...}}`, the meta_info's per-token
    lists holding only the tokens the frame adds (router/api/sglang/run.py); a batch's events
    carry the `index` of their generation (each frame made as its event was recorded:
    Run.keep_frame). A frame with many numbers (a prompt's hidden states) is encoded off the
    event loop."""

    def __init__(self, runs: list[Run]):
        self.runs = runs

    async def event_frames(self, index: int, event: TokenEvent) -> list[bytes]:
        run = self.runs[index]
        frame = run.frames.popleft()
        if frame is None:  # between two frames of its stream_interval
            return []
        return [openai_sse(await dumps(run.frame_output(frame), numbers=frame.numbers,
                                       **STREAM_JSON))]

    def error(self, err: RouterError) -> bytes:
        return openai_sse(sglang_error_body(err))

    def done(self) -> list[bytes]:
        return [openai_sse("[DONE]")]


async def generate(request: web.Request, body: dict) -> web.StreamResponse:
    """POST /generate with an SGLang body; errors in SGLang's `{"error": {"message"}}` shape.

    A request SGLang would refuse is a 400 there (its tokenizer manager's ValueError, and FastAPI's
    422 turned into a 400): every validation error of this route is a 400 too."""
    request[ERROR_BODY] = sglang_error_body  # the error middleware answers in it
    with request_span("sglang_generate", request.headers):
        try:
            return await _generate(request, body)
        except ValidationError as err:  # an unknown adapter too, even one unloaded after checks
            raise SglangBadRequest(err.message) from None


async def _generate(request: web.Request, body: dict) -> web.StreamResponse:
    served = served_model(request)
    started = time.monotonic()
    batch = await served.infer.count_request(parse_generate(
        body, served.tokenizer, served.validation_limits, served.config.max_client_batch_size,
        served.shard_info.hidden_size, adapters=served.adapters, images=served.images,
        media=request.app[STATE].media, model=served.model_name))
    running = request.app[RUNNING]
    rids = list(dict.fromkeys(item.rid for item in batch.items))
    taken = [rid for rid in rids if rid in running]
    if taken:
        error = ValidationError(f"a request with rid {taken[0]!r} is already running")
        served.infer.record_failure(error)
        raise error
    runs = [Run(item, Timings(started_at=started)) for item in batch.items]
    for run in runs:
        running.setdefault(run.item.rid, []).append(run)
    try:
        if batch.stream:
            for index, run in enumerate(runs):
                run.stream_frames(index if batch.as_list else None)
            return await serve_stream(request, _events(served.infer, runs),
                                      SglangStream(runs), streams=len(runs))
        async for _ in _events(served.infer, runs):
            pass
        outputs = [run.output() for run in runs]
        # as web.json_response writes it; a prompt's hidden states are encoded off the loop
        text = await dumps(outputs if batch.as_list else outputs[0],
                           numbers=sum(run.numbers() for run in runs))
        return web.Response(text=text, content_type="application/json")
    finally:
        for rid in rids:
            running.pop(rid, None)


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's AbortReq: `rid`, or `abort_all`. An unknown rid is no error (it may have ended)."""
    request[ERROR_BODY] = sglang_error_body
    try:
        return await _abort_request(request)
    except (ValidationError, BadRequestError) as err:  # SGLang's 400, as on /generate
        raise SglangBadRequest(err.message, close_connection=err.close_connection) from None


async def _abort_request(request: web.Request) -> web.Response:
    body = await read_object(request)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise ValidationError("`abort_all` must be a boolean")
    if not abort_all and not isinstance(rid, str):
        raise ValidationError("`rid` must be a string (or give `abort_all`: true)")
    running = request.app[RUNNING]
    runs = [r for rs in running.values() for r in rs] if abort_all else running.get(rid, [])
    for run in runs:
        run.abort()
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """Drops the prefix cache, only when no request is in flight (as SGLang: 400 otherwise)."""
    served = served_model(request)
    message = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
               "running or waiting requests, the operation will not be performed.)\n")
    if served.infer.in_flight:
        return web.Response(status=400, text=message)
    if not served.flush_prefix_cache():
        return web.Response(status=400, text=message)
    return web.Response(status=200, text=message)


async def health_generate(request: web.Request) -> web.Response:
    """Health that runs one real token through the queue, the scheduler and the shards.

    Of the model /health asks about: a stopped one is a 503, as there."""
    served = await healthy_model(request.app[STATE], request.headers.get(MODEL_HEADER))
    input_ids = served.tokenizer.encode("Hi") or [0]
    probe = GenerateRequest(inputs="Hi", input_ids=input_ids, sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True))
    try:
        await served.infer.generate(probe)
    except OverloadedError:
        pass  # busy at its concurrency limit is alive: a restart would only lose requests
    except RouterError as err:
        raise UnhealthyError(f"a one-token generation failed: {err}") from None
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    served = served_model(request)
    return web.json_response({"model_path": served.model_name,
                              "tokenizer_path": served.config.tokenizer_path,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default",
                              # ours: the width of an input_embeds row and of a hidden state
                              "hidden_size": served.shard_info.hidden_size})


async def get_server_info(request: web.Request) -> web.Response:
    served = served_model(request)
    return web.json_response({
        **served.info_json(), "model_path": served.model_name,
        "tokenizer_path": served.config.tokenizer_path,
        "max_total_num_tokens": served.kv_capacity_tokens, "page_size": served.kv_block_size,
        "version": VERSION})


def register(app: web.Application) -> None:
    app[RUNNING] = {}
    app[tgi.GENERATE_DIALECTS].append((is_sglang_body, generate))
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
