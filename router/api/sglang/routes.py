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
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from router import VERSION
from router.api.sglang.lora import SglangBadRequest
from router.api.sglang.request import SglangItem, is_sglang_body, parse_generate
from router.api.tgi import routes as tgi
from router.core.generation import FanOutStream
from router.api.sglang.errors import sglang_error_body
from router.errors import (OverloadedError, RouterError, UnhealthyError, UnknownAdapterError,
                           ValidationError)
from router.http.middleware import ERROR_BODY
from router.http.json_body import read_object
from router.http.sse import StreamFormat, openai_sse, serve_stream
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Timings, Token, TokenEvent)
from router.state import MODEL_HEADER, STATE, healthy_model, served_model
from router.telemetry.tracing import request_span

# rid -> the runs that carry it (n copies of one prompt share their rid)
RUNNING = web.AppKey("sglang_running", dict)


@dataclass(eq=False)
class Run:
    """One generation of an SGLang request, as its events arrive."""

    item: SglangItem
    timings: Timings
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[Token] = field(default_factory=list)
    prefill_top_tokens: list[list[Token]] = field(default_factory=list)
    prefill_ids_logprobs: list[list[float | None]] = field(default_factory=list)
    ids_logprobs: list[list[float | None]] = field(default_factory=list)  # per output token
    hidden_states: list = field(default_factory=list)  # the prompt's rows, then one per step
    final: FinalInfo | None = None
    stream: FanOutStream = field(init=False)  # its stream in the fan-out: aborts it alone
    # streamed: each event's frame, made as it is recorded (the run may have recorded later
    # events, several a decode call, before the writer gets to this one); `frame_index` is the
    # index a frame carries in a batch
    frames: deque | None = None
    frame_index: int | None = None

    def __post_init__(self) -> None:
        self.stream = FanOutStream(timings=self.timings)

    def stream_frames(self, index: int | None) -> None:
        self.frames, self.frame_index = deque(), index

    def keep_frame(self) -> None:
        if self.frames is not None:
            self.frames.append(self.output(self.frame_index))

    @property
    def request(self) -> GenerateRequest:
        return self.item.request

    def record(self, event: TokenEvent) -> None:
        self.tokens.append(event.token)
        self.top_tokens.append(event.top_tokens)
        if event.prefill is not None:
            self.prefill = event.prefill
        if event.prefill_top_tokens is not None:
            self.prefill_top_tokens = event.prefill_top_tokens
        if event.prefill_token_ids_logprobs is not None:
            self.prefill_ids_logprobs = event.prefill_token_ids_logprobs
        if event.token_ids_logprobs:
            self.ids_logprobs.append(event.token_ids_logprobs)
        if event.hidden_states is not None:
            # SGLang's layout: the prompt's rows as one entry, then one vector per decode step
            self.hidden_states.append(event.hidden_states if not self.hidden_states
                                      else event.hidden_states[0])
        if event.final is not None:
            self.final = event.final

    def abort(self) -> None:
        self.stream.abort()

    @property
    def aborted(self) -> bool:
        return self.stream.aborted

    def arrived(self, event: TokenEvent) -> None:
        """Records an event as the core hands it over.

        The writer may lag behind. The event is framed too when streamed; an aborted run's last
        event is framed only."""
        if not self.aborted:
            self.record(event)
        self.keep_frame()

    @property
    def done(self) -> bool:
        return self.final is not None or self.aborted

    def text(self) -> str:
        """The text so far; at the end without what stopped it, unless `no_stop_trim`."""
        final = self.final
        if final is None:
            return "".join(t.text for t in self.tokens)
        text = final.text
        if self.item.no_stop_trim:
            return text
        if final.finish_reason is FinishReason.STOP_SEQUENCE:
            stop = self._matched_stop(text)
            return text[:-len(stop)] if stop else text
        if final.finish_reason is FinishReason.EOS_TOKEN and self.tokens:
            last = self.tokens[-1].text
            if last and text.endswith(last):
                return text[:-len(last)]
        return text

    def _matched_stop(self, text: str) -> str | None:
        ends = [s for s in self.request.stopping.stop_sequences if text.endswith(s)]
        return max(ends, key=len) if ends else None

    def finish_reason(self) -> dict | None:
        if self.aborted:
            return {"type": "abort", "message": "aborted by /abort_request"}
        final = self.final
        if final is None:
            return None
        if final.finish_reason is FinishReason.LENGTH:
            return {"type": "length", "length": self.request.stopping.max_new_tokens}
        if final.finish_reason is FinishReason.STOP_SEQUENCE:
            return {"type": "stop", "matched": self._matched_stop(final.text)}
        # an end-of-sequence id or one of stop_token_ids: the last token
        return {"type": "stop", "matched": self.tokens[-1].id if self.tokens else None}

    def meta_info(self) -> dict:
        meta = {"id": self.item.rid, "finish_reason": self.finish_reason(),
                "prompt_tokens": self.request.input_length,
                "completion_tokens": len(self.tokens),
                "cached_tokens": self.timings.cached_tokens,
                "e2e_latency": time.monotonic() - self.timings.started_at}
        options = self.item.logprobs
        if options.enabled:
            entry = (lambda t: [t.logprob, t.id, t.text]) if options.with_text else \
                (lambda t: [t.logprob, t.id, None])
            start = options.start_len
            prompt = self.prefill[start:] if start >= 0 else []
            if prompt:  # the first prompt token has no log-probability
                prompt = [Token(prompt[0].id, prompt[0].text, None)] + prompt[1:] \
                    if start == 0 else prompt
            meta["input_token_logprobs"] = [entry(t) for t in prompt]
            meta["output_token_logprobs"] = [entry(t) for t in self.tokens]
            if options.top_n:
                meta["input_top_logprobs"] = [
                    [entry(t) for t in step] or None
                    for step in (self.prefill_top_tokens[start:] if start >= 0 else [])]
                meta["output_top_logprobs"] = [[entry(t) for t in step]
                                               for step in self.top_tokens]
            asked = options.token_ids
            if asked:
                texts = options.token_texts
                named = (lambda row: [[lp, i, text] for lp, i, text in zip(row, asked, texts)])
                meta["input_token_ids_logprobs"] = [
                    named(row) if position + max(start, 0) else None
                    for position, row in enumerate(
                        self.prefill_ids_logprobs[start:] if start >= 0 else [])]
                meta["output_token_ids_logprobs"] = [named(row) for row in self.ids_logprobs]
        if self.item.return_hidden_states:
            meta["hidden_states"] = self.hidden_states
        return meta

    def output(self, index: int | None = None) -> dict:
        out = {"text": self.text(), "meta_info": self.meta_info()}
        if index is not None:
            out["index"] = index
        return out


def _events(infer, runs: list[Run]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(index, event) of every run as they arrive.

    Through the core's fan-out (each run abortable alone; an aborted run ends with an event of its
    own)."""
    return infer.stream_many([run.request for run in runs], streams=[run.stream for run in runs],
                             on_event=lambda index, event: runs[index].arrived(event))


class SglangStream(StreamFormat):
    """SGLang's stream: a `data:` frame per token, `data: [DONE]` at the end.

    Each frame is `data: {"text": <text so far>, "meta_info": {...}}`; a batch's events carry the
    `index` of their generation (each frame made as its event was recorded: Run.keep_frame)."""

    def __init__(self, runs: list[Run]):
        self.runs = runs

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        return [openai_sse(self.runs[index].frames.popleft())]

    def error(self, err: RouterError) -> bytes:
        return openai_sse(sglang_error_body(err))

    def done(self) -> list[bytes]:
        return [openai_sse("[DONE]")]


async def generate(request: web.Request, body: dict) -> web.StreamResponse:
    """POST /generate with an SGLang body; errors in SGLang's `{"error": {"message"}}` shape."""
    request[ERROR_BODY] = sglang_error_body  # the error middleware answers in it
    with request_span("sglang_generate", request.headers):
        try:
            return await _generate(request, body)
        except UnknownAdapterError as err:  # unloaded after validation: SGLang's 400 still
            raise SglangBadRequest(err.message) from None


async def _generate(request: web.Request, body: dict) -> web.StreamResponse:
    served = served_model(request)
    started = time.monotonic()
    batch = await served.infer.count_request(parse_generate(
        body, served.tokenizer, served.validation_limits, served.config.max_client_batch_size,
        served.shard_info.hidden_size, adapters=served.adapters))
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
        return web.json_response(outputs if batch.as_list else outputs[0])
    finally:
        for rid in rids:
            running.pop(rid, None)


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's AbortReq: `rid`, or `abort_all`. An unknown rid is no error (it may have ended)."""
    request[ERROR_BODY] = sglang_error_body
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
