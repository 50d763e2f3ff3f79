"""The public gRPC API (proto/api.proto), served beside the HTTP one.

Generate, GenerateStream, Tokenize, Info, Health and Embed through the same validation, queue,
batching, cancellation, metrics and API key, with the standard grpc.health.v1.Health service and
server reflection. On when --grpc-port is set; router/api/grpc/server.py runs the server.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import api_pb2 as api
from proto import api_pb2_grpc
from router.api.grpc import convert
from router.api.tgi import embed as tei
from router.api.tgi import routes as tgi
from router.api.grpc.status import grpc_error_trailers, grpc_status_code
from router.errors import (IncompleteGenerationError, ModelNotFoundError, ModelStateError,
                           RouterError, SlowReaderError, UnhealthyError)
from router.inputs.validation import ValidatedGenerate
from router.schemas import Timings
from router.state import RouterState, healthy_model
from router.telemetry.tracing import record_phases, request_span

log = logging.getLogger("tgi.router.grpc")

SERVICE = api.DESCRIPTOR.services_by_name["TextGeneration"].full_name  # "tgi.v1.TextGeneration"
# open without a key: health checks, as GET /health is (probes and load balancers carry no
# credentials), and reflection, which only describes proto/api.proto (shipped in the package) and
# which grpcurl needs before any call, a keyless health check included
PUBLIC_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})
PUBLIC_METHODS = frozenset({f"/{SERVICE}/Health"})
UNAUTHENTICATED = "Unauthorized: a valid 'authorization: Bearer <key>' metadata entry is required"
# how often grpc.health.v1's status is re-checked for Watch streams (Check always asks live)
HEALTH_REFRESH_S = 5.0
# how long the status of a call whose client stopped reading may wait for it (_abort_unread)
UNREAD_ABORT_S = 1.0


# ---- the router core, driven as router/api/tgi/routes.py drives it --------------------------------------
# Every use of the router's state is in this section, so a renamed attribute is one edit here.
# The gRPC API serves the default model (the launcher's --model-id).

async def validate(state: RouterState, body: dict, *, stream: bool) -> ValidatedGenerate:
    """TGI's parameters validated and counted (tgi_request_count, failures) as /generate does."""
    return await tgi.validate(state.served(None), body, stream=stream, media=state.media)


async def generate(state: RouterState, validated: ValidatedGenerate, timings: Timings):
    """(the answer, the other best_of sequences)."""
    return await state.served(None).infer.generate_best_of(validated.request, validated.best_of,
                                                           timings)


def token_events(state: RouterState, validated: ValidatedGenerate, timings: Timings):
    """The request's TokenEvents; closing the iterator early cancels it and frees its KV blocks."""
    return state.served(None).infer.stream(validated.request, timings)


def write_timeout(state: RouterState) -> float:
    """--stream-write-timeout: how long a stream's message may wait for its client to take it."""
    return state.config.stream_write_timeout


async def tokenize(state: RouterState, inputs: str) -> tuple[list[int], list[tuple[int, int]]]:
    return await state.served(None).tokenizer.encode_offsets_async(inputs)


def info(state: RouterState) -> dict:
    return state.served(None).info_json()


async def embed(state: RouterState, body: dict) -> tei.EmbedAnswer:
    """TEI's /embed body answered as the route answers it, by the default model."""
    return await tei.embed_body(lambda: state.served(None), body)


async def check_health(state: RouterState) -> None:
    """Returns when GET /health answers 200; raises the UnhealthyError of its 503 otherwise."""
    await healthy_model(state, None)


# ---- the service ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What a request's bytes became when they were not a message of the method's type."""
    message_type: str
    error: str


def _decoder(message_class):
    """`message_class.FromString` that hands the servicer an _Undecodable rather than raise.

    grpc answered a raising deserializer with UNKNOWN and logged a traceback per call."""
    def decode(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return _Undecodable(message_class.DESCRIPTOR.full_name, str(err))

    return decode


def add_service(servicer, server: grpc.aio.Server) -> None:
    """Adds the TextGeneration service's methods to `server`, decoding with _decoder.

    As the generated add_TextGenerationServicer_to_server adds them."""
    service = api.DESCRIPTOR.services_by_name["TextGeneration"]
    handlers = {}
    for method in service.methods:
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_decoder(getattr(api, method.input_type.name)),
            response_serializer=getattr(api, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name,
                                                                         handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _rpc(method):
    """Ends a call that raised with the gRPC status of its error.

    For a RouterError, with TGI's message (its error_type and Retry-After in the trailers); anything
    else is logged and INTERNAL. A request that did not decode is INVALID_ARGUMENT."""

    @functools.wraps(method)
    async def handle(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {request.message_type} message: "
                                f"{request.error}")
        try:
            return await method(self, request, context)
        except SlowReaderError as err:
            log.info("%s ended: %s", method.__name__, err)
            await _abort_unread(context, err)
        except RouterError as err:
            await context.abort(grpc_status_code(err), str(err),
                                trailing_metadata=grpc_error_trailers(err))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "Internal server error")

    return handle


async def _write(context: grpc.aio.ServicerContext, message, timeout: float) -> None:
    """context.write, which waits while the client's flow-control window is full: `timeout` at most.

    Without the bound a client that stops reading (its window stays full) held the call, and
    with it its generation, its KV blocks and its slot, for as long as it stayed connected. Past
    it the call ends with DEADLINE_EXCEEDED (the client reads that status after the messages it
    has), and the caller's `finally` cancels the generation.
    """
    try:
        async with asyncio.timeout(timeout):
            await context.write(message)
    except TimeoutError:
        raise SlowReaderError(f"the client took no message for {timeout:g} s "
                              "(--stream-write-timeout): the stream and its generation were "
                              "ended") from None


async def _abort_unread(context: grpc.aio.ServicerContext, err: SlowReaderError) -> None:
    """Ends the call of a client that stopped reading, without waiting for it to read again.

    The status goes out after the messages the client has not taken, so context.abort waits for
    it to read them. Past UNREAD_ABORT_S the handler is cancelled instead: grpc then resets the
    stream, and the client still hears the status queued behind its messages.
    """
    try:
        async with asyncio.timeout(UNREAD_ABORT_S):
            await context.abort(grpc_status_code(err), str(err),
                                trailing_metadata=grpc_error_trailers(err))
    except TimeoutError:
        raise asyncio.CancelledError from None


def _span(name: str, context: grpc.aio.ServicerContext):
    """The call's trace span, child of the caller's `traceparent` metadata if it sent one."""
    metadata = {m.key: m.value for m in context.invocation_metadata() or ()}
    return request_span(f"{SERVICE}/{name}", metadata)


class TextGenerationServicer(api_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: RouterState):
        self.state = state

    @_rpc
    async def Generate(self, request: api.GenerateRequest, context) -> api.GenerateResponse:
        timings = Timings(started_at=time.monotonic())
        with _span("Generate", context):
            validated = await validate(self.state, convert.generate_body(request), stream=False)
            best, others = await generate(self.state, validated, timings)
            record_phases(best.timings)
        return convert.generate_response(best, others, validated,
                                         validated.output_prefix(full_text_default=False))

    @_rpc
    async def GenerateStream(self, request: api.GenerateRequest, context) -> None:
        timings = Timings(started_at=time.monotonic())
        with _span("GenerateStream", context):
            validated = await validate(self.state, convert.generate_body(request), stream=True)
            prefix = validated.output_prefix(full_text_default=False)
            events = token_events(self.state, validated, timings)
            timeout = write_timeout(self.state)
            try:
                index, final = 0, None
                # read to the end, not just to the final event: the core records the request's
                # success (metrics, timings) after handing that event out
                async for event in events:
                    index += 1
                    await _write(context, convert.stream_response(event, index, validated,
                                                                  prefix), timeout)
                    final = event.final
                if final is None:
                    raise IncompleteGenerationError("Incomplete generation stream")
                record_phases(timings)
            finally:
                # also when the call is cancelled (the client went away, its deadline passed):
                # grpc cancels this task, and closing the events frees the request's blocks
                await events.aclose()

    @_rpc
    async def Tokenize(self, request: api.TokenizeRequest, context) -> api.TokenizeResponse:
        ids, offsets = await tokenize(self.state, request.inputs)
        # a long text's answer takes a while to build: off the event loop, as /tokenize's
        return await asyncio.to_thread(convert.tokenize_response, request.inputs, ids, offsets)

    @_rpc
    async def Info(self, request: api.InfoRequest, context) -> api.InfoResponse:
        return convert.info_response(info(self.state))

    @_rpc
    async def Health(self, request: api.HealthRequest, context) -> api.HealthResponse:
        await check_health(self.state)
        return api.HealthResponse()

    @_rpc
    async def Embed(self, request: api.EmbedRequest, context) -> api.EmbedResponse:
        started = time.monotonic_ns()
        with _span("Embed", context):
            answer = await embed(self.state, convert.embed_body(request))
        return convert.embed_response(answer.vectors, chars=len(request.inputs),
                                      tokens=answer.prompt_tokens,
                                      total_ns=time.monotonic_ns() - started)


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StandardHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health, in step with the Health RPC.

    For the server ("") and tgi.v1.TextGeneration: Check runs the same check live, and a task
    re-runs it every HEALTH_REFRESH_S for Watch streams. From shutdown on it answers NOT_SERVING,
    and a Watch stream ends once it has said so (grpc_health's own servicer keeps it open, which
    holds the server's graceful stop for its whole grace period)."""

    SERVICES = (health.OVERALL_HEALTH, SERVICE)

    def __init__(self, state: RouterState):
        self.state = state
        self.status = _NOT_SERVING
        self.version = 0  # counts changes of status, so that a Watch stream waits for the next
        self.is_stopping = False
        self.changed = asyncio.Condition()

    async def refresh(self) -> None:
        try:
            await check_health(self.state)
            status = _SERVING
        except (UnhealthyError, ModelNotFoundError, ModelStateError):  # its model stopped too
            status = _NOT_SERVING
        except Exception:  # a bug in the check: say so, and report not serving
            log.exception("health check raised")
            status = _NOT_SERVING
        await self._set(status)

    async def stop(self) -> None:
        await self._set(_NOT_SERVING, stopping=True)

    async def _set(self, status, *, stopping: bool = False) -> None:
        async with self.changed:
            if self.is_stopping or (status == self.status and not stopping):
                return
            self.status, self.is_stopping = status, stopping
            self.version += 1
            self.changed.notify_all()

    async def Check(self, request, context):
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        await self.refresh()
        return health_pb2.HealthCheckResponse(status=self.status)

    async def Watch(self, request, context):
        last = None
        while True:
            version = self.version
            status = (self.status if request.service in self.SERVICES
                      else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self.is_stopping:
                return
            async with self.changed:
                await self.changed.wait_for(lambda v=version: self.version != v)

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(HEALTH_REFRESH_S)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without the API key, except health checks and reflection.

    The key goes in metadata `authorization: Bearer <key>`: exactly what the HTTP API's
    Authorization header must hold (router/http/middleware.py)."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in PUBLIC_METHODS \
                or details.method.split("/")[1] in PUBLIC_SERVICES:
            return handler
        given = next((value for key, value in details.invocation_metadata or ()
                      if key == "authorization"), "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self.expected):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            make = getattr(grpc, f"{kind}_rpc_method_handler")
            return make(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise AssertionError(f"a method handler of no known kind: {handler}")
