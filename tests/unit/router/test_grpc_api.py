"""The public gRPC API without a model: proto -> TGI's JSON body, errors -> gRPC status, and an
in-process server over a scripted router core (cancellation, API key, errors mid-stream)."""
import asyncio
import socket
import struct
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from proto import api_pb2 as api
from proto import api_pb2_grpc
from router import errors
from router.api.grpc import convert
from router.api.grpc import server as grpc_server
from router.api.grpc import service as grpc_service
from router.api.grpc import status
from router.errors import ValidationError
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import (INTEGER_WIRE_TYPES, PARAMETER_TYPES, TokenLimits,
                                      ValidatedGenerate, ValidationLimits, validate_generate)
from router.schemas import (FinalInfo, FinishReason, GenerateRequest, SamplingParams,
                            StoppingParams, Token, TokenEvent)
from tests.tiny_models import build_tokenizer

ROOT = Path(__file__).resolve().parents[3]
F = FieldDescriptor


# ---- proto -> TGI's parameters -------------------------------------------------------------------

_PROTO_TYPES = {"boolean": F.TYPE_BOOL, "number": F.TYPE_FLOAT, "string": F.TYPE_STRING,
                "object": F.TYPE_MESSAGE, "array": F.TYPE_STRING}
_INT_TYPES = {"i32": F.TYPE_INT32, "u32": F.TYPE_UINT32, "u64": F.TYPE_UINT64}


def test_every_tgi_parameter_is_a_field_of_its_type():
    fields = api.GenerateParameters.DESCRIPTOR.fields_by_name
    assert set(fields) == set(PARAMETER_TYPES)
    for name, kind in PARAMETER_TYPES.items():
        field = fields[name]
        expected = (_INT_TYPES[INTEGER_WIRE_TYPES[name].name] if kind == "integer"
                    else _PROTO_TYPES[kind])
        assert field.type == expected, name
        # unset must differ from zero: TGI's default is not always the zero value
        assert field.has_presence or kind == "array", name


def test_only_the_fields_set_reach_the_body():
    assert convert.generate_body(api.GenerateRequest(inputs="Hi")) == {
        "inputs": "Hi", "parameters": {}}
    request = api.GenerateRequest(inputs="Hi", parameters=api.GenerateParameters(
        temperature=0.0, do_sample=False, top_k=0, stop=["a", "b"], seed=2**64 - 1,
        grammar=api.Grammar(type="regex", value="[0-9]+")))
    assert convert.generate_body(request) == {"inputs": "Hi", "parameters": {
        "temperature": 0.0, "do_sample": False, "top_k": 0, "stop": ["a", "b"], "seed": 2**64 - 1,
        "grammar": {"type": "regex", "value": "[0-9]+"}}}


def test_an_embed_request_is_teis_body_with_only_the_fields_set():
    assert convert.embed_body(api.EmbedRequest(inputs="Hi")) == {"inputs": "Hi"}
    request = api.EmbedRequest(inputs="Hi", truncate=False, normalize=False, dimensions=0,
                               truncation_direction=api.TRUNCATION_DIRECTION_LEFT)
    assert convert.embed_body(request) == {"inputs": "Hi", "truncate": False, "normalize": False,
                                           "dimensions": 0, "truncation_direction": "Left"}
    # text-embeddings-inference's field numbers: its clients' bytes read as theirs
    fields = api.EmbedRequest.DESCRIPTOR.fields_by_name
    assert {name: f.number for name, f in fields.items()} == {
        "inputs": 1, "truncate": 2, "normalize": 3, "truncation_direction": 4, "dimensions": 6}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return RouterTokenizer(str(directory))


LIMITS = ValidationLimits(TokenLimits(max_input_tokens=64, max_total_tokens=128,
                                      max_batch_prefill_tokens=256),
                          max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5)


async def _error(body: dict, tokenizer, *, stream=False) -> str:
    with pytest.raises(ValidationError) as err:
        await validate_generate(body, tokenizer, LIMITS, stream=stream)
    return str(err.value)


@pytest.mark.parametrize("params", [
    {"temperature": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"typical_p": 1.0},
    {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0}, {"max_new_tokens": 0},
    {"max_new_tokens": 200}, {"truncate": 65}, {"top_n_tokens": 6}, {"best_of": 3},
    {"stop": ["a"] * 5}, {"adapter_id": "lora"}, {"temperature": float("nan")},
    {"top_p": float("inf")}, {"grammar": {"type": "ebnf", "value": "x"}},
    {"grammar": {"type": "json", "value": "{"}},
])
async def test_a_bad_field_gets_the_message_json_gets(tokenizer, params):
    proto_params = dict(params)
    if "grammar" in params:
        proto_params["grammar"] = api.Grammar(**params["grammar"])
    request = api.GenerateRequest(inputs="Hello", parameters=api.GenerateParameters(**proto_params))
    assert await _error(convert.generate_body(request), tokenizer) == \
        await _error({"inputs": "Hello", "parameters": params}, tokenizer)


async def test_a_valid_request_reaches_the_shards_as_json_does(tokenizer):
    params = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "typical_p": 0.95,
              "repetition_penalty": 1.3, "frequency_penalty": 0.5, "seed": 7, "do_sample": True,
              "max_new_tokens": 20, "stop": ["x"], "top_n_tokens": 2, "truncate": 3,
              "watermark": True, "details": True, "decoder_input_details": True,
              "return_full_text": True, "ignore_eos": True}
    body = convert.generate_body(api.GenerateRequest(
        inputs="Once upon a time", parameters=api.GenerateParameters(**params)))
    ours = await validate_generate(body, tokenizer, LIMITS)
    theirs = await validate_generate({"inputs": "Once upon a time", "parameters": params},
                                     tokenizer, LIMITS)
    # floats travel to the shards as float32: the same float32, whichever API they came from
    def f32(value):
        return struct.pack("f", value) if isinstance(value, float) else value

    for name in SamplingParams.__slots__:
        assert f32(getattr(ours.request.sampling, name)) == \
            f32(getattr(theirs.request.sampling, name)), name
    ours.request.sampling = theirs.request.sampling
    assert ours == theirs


# ---- errors -> gRPC status ----------------------------------------------------------------------

@pytest.mark.parametrize("error,code", [
    (errors.ValidationError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.BadRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.TemplateError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.OverloadedError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnhealthyError(), grpc.StatusCode.UNAVAILABLE),
    (errors.GenerationError("x"), grpc.StatusCode.INTERNAL),
    (errors.IncompleteGenerationError(), grpc.StatusCode.INTERNAL),
    (errors.RouterError("x"), grpc.StatusCode.INTERNAL),
    (errors.NotServedError("x"), grpc.StatusCode.FAILED_PRECONDITION),
])
def test_error_status_codes(error, code):
    assert status.grpc_status_code(error) == code
    trailers = dict(status.grpc_error_trailers(error))
    assert trailers["tgi-error-type"] == error.error_type
    assert ("retry-after" in trailers) == ("Retry-After" in error.headers)


def test_every_status_the_router_answers_has_a_code():
    statuses = {cls.status for cls in vars(errors).values()
                if isinstance(cls, type) and issubclass(cls, errors.RouterError)}
    assert statuses <= set(status.GRPC_STATUS_CODES)


# ---- an in-process server over a scripted core ---------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _validated(body: dict, *, details=True) -> ValidatedGenerate:
    request = GenerateRequest(inputs=body["inputs"], input_ids=[1, 2, 3],
                              sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=5))
    return ValidatedGenerate(request, best_of=1, details=details, return_full_text=None,
                             decoder_input_details=False)


class ScriptedCore:
    """Stands in for the router core grpc_service drives: events are scripted per prompt."""

    def __init__(self):
        self.closed = asyncio.Event()
        self.healthy = True
        self.channel = self.port = self.server = None

    async def validate(self, state, body, *, stream):
        if body["parameters"].get("temperature") == 0.0:
            raise ValidationError("`temperature` must be strictly positive")
        return _validated(body)

    def token_events(self, state, validated, timings):
        return self._events(validated.request.inputs)

    async def _events(self, prompt: str):
        try:
            if prompt == "busy":
                raise errors.OverloadedError()
            for i in range(3):
                yield TokenEvent(Token(i, f"t{i}", -0.5))
            if prompt == "shard dies":
                raise errors.GenerationError("the shard died")
            if prompt == "forever":
                while True:
                    await asyncio.sleep(0.01)
                    yield TokenEvent(Token(9, "x", -0.1))
            yield TokenEvent(Token(3, "!", -0.25),
                             final=FinalInfo("t0t1t2!", 4, FinishReason.LENGTH, None))
        finally:
            self.closed.set()

    async def check_health(self, state):
        if not self.healthy:
            raise errors.UnhealthyError("the model shards are restarting")


@pytest.fixture
async def served(monkeypatch):
    core = ScriptedCore()
    for name in ("validate", "token_events", "check_health"):
        monkeypatch.setattr(grpc_service, name, getattr(core, name))
    core.port = port = _free_port()
    config = SimpleNamespace(hostname="127.0.0.1", grpc_port=port, api_key="k",
                             payload_limit=1000, stream_write_timeout=0.5, drain_timeout=5.0)
    core.server = server = grpc_server.GrpcServer(SimpleNamespace(config=config))
    await server.start(None)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        core.channel = channel
        yield core, api_pb2_grpc.TextGenerationStub(channel)
    await server.drain(None)
    await server.stop(None)


KEY = (("authorization", "Bearer k"),)


async def test_a_stream_ends_with_the_text_and_details(served):
    core, stub = served
    messages = [m async for m in stub.GenerateStream(api.GenerateRequest(inputs="hi"),
                                                     metadata=KEY)]
    assert [m.token.text for m in messages] == ["t0", "t1", "t2", "!"]
    assert messages[-1].generated_text == "t0t1t2!"
    assert messages[-1].details.generated_tokens == 4
    assert messages[-1].details.input_length == 3 and not messages[-1].details.HasField("seed")
    assert core.closed.is_set()


async def test_a_cancelled_stream_closes_the_events(served):
    core, stub = served
    call = stub.GenerateStream(api.GenerateRequest(inputs="forever"), metadata=KEY)
    await call.read()
    call.cancel()
    await asyncio.wait_for(core.closed.wait(), timeout=5)


async def test_a_deadline_closes_the_events(served):
    core, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.GenerateStream(api.GenerateRequest(inputs="forever"), metadata=KEY,
                                           timeout=0.2):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(core.closed.wait(), timeout=5)


async def test_a_client_that_stops_reading_is_ended_after_the_write_timeout(served):
    core, _ = served
    # a window of 1 KB that only reading opens again: the server's writes wait after a few
    # dozen messages, as they do for any client that stops reading once its window is full
    small = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{core.port}", options=small) as channel:
        call = api_pb2_grpc.TextGenerationStub(channel).GenerateStream(
            api.GenerateRequest(inputs="forever"), metadata=KEY)
        await call.read()
        # stream_write_timeout is 0.5 s: the call ends, and its events (its generation) with it
        await asyncio.wait_for(core.closed.wait(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took no message for 0.5 s (--stream-write-timeout)" in err.value.details()
    assert ("tgi-error-type", "slow_reader") in tuple(err.value.trailing_metadata())


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # and SETTINGS
_SETTINGS_ACK = bytes(3) + b"\x04\x01" + bytes(4)
_GOAWAY, _PING = 7, 6


async def _frames_until_closed(port: int, timeout: float) -> list[int]:
    """The frame types a raw HTTP/2 peer hears until the server closes its connection.

    The peer acknowledges the server's SETTINGS and nothing more: no PING is answered.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_PREFACE)
    types = []
    try:
        async with asyncio.timeout(timeout):
            while header := await reader.read(9):
                length, kind, flags = int.from_bytes(header[:3], "big"), header[3], header[4]
                await reader.readexactly(length)
                types.append(kind)
                if kind == 4 and not flags & 1:
                    writer.write(_SETTINGS_ACK)
    except (ConnectionResetError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
    return types


@pytest.mark.parametrize("keepalive,heard", [
    (grpc_server.Keepalive(time_s=0.2, timeout_s=0.3, idle_s=3600), [_PING, _GOAWAY]),
    (grpc_server.Keepalive(time_s=3600, idle_s=0.3), [_GOAWAY])], ids=["unanswered ping", "idle"])
async def test_keepalive_closes_a_silent_peer_and_an_idle_connection(monkeypatch, keepalive,
                                                                     heard):
    monkeypatch.setattr(grpc_server, "KEEPALIVE", keepalive)
    port = _free_port()
    config = SimpleNamespace(hostname="127.0.0.1", grpc_port=port, api_key=None,
                             payload_limit=1000, stream_write_timeout=1.0)
    server = grpc_server.GrpcServer(SimpleNamespace(config=config))
    await server.start(None)
    try:
        # grpc's defaults (no keepalive ping for two hours, no idle limit) kept both open
        types = await _frames_until_closed(port, timeout=10)
    finally:
        await server.stop(None)
    assert [t for t in types if t in (_PING, _GOAWAY)] == heard


@pytest.mark.parametrize("inputs,params,code,message", [
    ("hi", {"temperature": 0.0}, grpc.StatusCode.INVALID_ARGUMENT,
     "Input validation error: `temperature` must be strictly positive"),
    ("busy", {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded"),
    ("shard dies", {}, grpc.StatusCode.INTERNAL,
     "Request failed during generation: Server error: the shard died"),
])
async def test_errors_end_the_stream_with_their_status(served, inputs, params, code, message):
    _, stub = served
    call = stub.GenerateStream(api.GenerateRequest(
        inputs=inputs, parameters=api.GenerateParameters(**params)), metadata=KEY)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert (err.value.code(), err.value.details()) == (code, message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert ("retry-after", "1") in tuple(err.value.trailing_metadata())


async def test_every_call_but_health_needs_the_key(served):
    _, stub = served
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "k"),)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(api.GenerateRequest(inputs="hi"), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.GenerateStream(api.GenerateRequest(inputs="hi"),
                                               metadata=metadata):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == grpc_service.UNAUTHENTICATED
    assert await stub.Health(api.HealthRequest()) == api.HealthResponse()


async def test_the_standard_health_service_follows_the_health_rpc(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    core, stub = served
    checker = health_pb2_grpc.HealthStub(core.channel)
    for service in ("", grpc_service.SERVICE):
        request = health_pb2.HealthCheckRequest(service=service)
        assert (await checker.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
    core.healthy = False
    assert (await checker.Check(request)).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Health(api.HealthRequest())
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                      "the model shards are restarting")


async def test_a_port_in_use_stops_the_start_with_a_message(served):
    core, _ = served
    port = core.port
    config = SimpleNamespace(hostname="127.0.0.1", grpc_port=port, api_key=None,
                             payload_limit=1000, stream_write_timeout=0.5, drain_timeout=5.0)
    # by default grpc would share the port (SO_REUSEPORT) and take half the first one's calls
    with pytest.raises(ValueError, match=f"--grpc-port {port}: cannot listen on 127.0.0.1:{port}"):
        await grpc_server.GrpcServer(SimpleNamespace(config=config)).start(None)


async def test_at_shutdown_watch_streams_hear_not_serving_and_end(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    core, _ = served
    watch = health_pb2_grpc.HealthStub(core.channel).Watch(
        health_pb2.HealthCheckRequest(service=grpc_service.SERVICE))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    await core.server.drain(None)
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await watch.read() is grpc.aio.EOF
    # an open Watch would otherwise hold the stop for the drain's grace
    await asyncio.wait_for(core.server.stop(None), timeout=5)


_NOT_MESSAGES = {"garbage": b"\xff\xff\xff\xff", "truncated": b"\x0a\x10abc",
                 "invalid utf-8": b"\x0a\x02\xc3\x28", "wrong wire type": b"\x0a\x02hi\x12\x02\x3d\x01"}


# a TokenizeRequest has no field 2: the last bytes decode as one, with an unknown field
@pytest.mark.parametrize("method,raw", [
    pytest.param(method, raw, id=f"{method}-{name}") for method in ("Generate", "GenerateStream",
                                                                     "Tokenize")
    for name, raw in _NOT_MESSAGES.items() if (method, name) != ("Tokenize", "wrong wire type")])
async def test_bytes_that_are_no_message_are_invalid_argument_without_a_traceback(
        served, caplog, method, raw):
    core, _ = served
    path = f"/{grpc_service.SERVICE}/{method}"
    same = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if method == "GenerateStream":
            async for _ in core.channel.unary_stream(path, **same)(raw, metadata=KEY):
                pass
        else:
            await core.channel.unary_unary(path, **same)(raw, metadata=KEY)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid tgi.v1." in caught.value.details()
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    # and the next call is served
    reply = await core.channel.unary_unary(f"/{grpc_service.SERVICE}/Health", **same)(
        api.HealthRequest().SerializeToString(), metadata=KEY)
    assert api.HealthResponse.FromString(reply) == api.HealthResponse()
