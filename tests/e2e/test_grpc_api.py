"""The public gRPC API (proto/api.proto) end to end on a tiny model, against the HTTP API of the
same server: same text, same details, same validation messages, same API key, nothing leaked."""
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import api_pb2, api_pb2_grpc
from tests.e2e.server import free_and_total_blocks, free_port, launch
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

API_KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
SERVICE = "tgi.v1.TextGeneration"


MAX_CONCURRENT = 2
WRITE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    grpc_port = free_port()
    # a call per step: the tiny model's 100-token generation must outlast a 50 ms deadline
    # (several steps a call made it finish in time now and then)
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("grpc-api"),
                      extra=["--max-input-tokens", "64", "--max-total-tokens", "128",
                             "--max-batch-prefill-tokens", "256", "--max-batch-total-tokens", "8192",
                             "--block-size", "4", "--grpc-port", str(grpc_port),
                             "--api-key", API_KEY, "--max-decode-steps-per-call", "1",
                             "--max-concurrent-requests", str(MAX_CONCURRENT),
                             "--stream-write-timeout", str(WRITE_TIMEOUT_S)])
    launched.grpc_target = f"127.0.0.1:{grpc_port}"
    yield launched
    assert launched.stop() == 0
    assert launched.processes_left() == []


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return api_pb2_grpc.TextGenerationStub(channel)


def post(server, path, body):
    return requests.post(f"{server.url}{path}", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}"})


def warm(server, inputs: str, params: dict) -> None:
    """Runs the request once so that its prompt's blocks are in the prefix cache for every run
    compared: a prompt computed afresh gets log-probabilities a float32 ulp away from a cached one."""
    assert post(server, "/generate", {"inputs": inputs, "parameters": params}).status_code == 200


def request_of(inputs: str, params: dict) -> api_pb2.GenerateRequest:
    """The gRPC request of TGI's JSON body {inputs, parameters: params}."""
    params = dict(params)
    if "grammar" in params:
        params["grammar"] = api_pb2.Grammar(**params["grammar"])
    return api_pb2.GenerateRequest(inputs=inputs, parameters=api_pb2.GenerateParameters(**params))


FINISH = {api_pb2.FINISH_REASON_LENGTH: "length", api_pb2.FINISH_REASON_EOS_TOKEN: "eos_token",
          api_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence"}


def token_json(token, *, with_special=True) -> dict:
    body = {"id": token.id, "text": token.text,
            "logprob": token.logprob if token.HasField("logprob") else None}
    if with_special:
        body["special"] = token.special
    return body


def details_json(details) -> dict:
    """Details as TGI's JSON writes them (top_tokens only when there are some)."""
    body = {"finish_reason": FINISH[details.finish_reason],
            "generated_tokens": details.generated_tokens,
            "seed": details.seed if details.HasField("seed") else None,
            "prefill": [token_json(t, with_special=False) for t in details.prefill],
            "tokens": [token_json(t) for t in details.tokens]}
    if details.top_tokens:
        body["top_tokens"] = [[token_json(t) for t in step.tokens] for step in details.top_tokens]
    return body


def test_greedy_generate_equals_http(server, stub):
    params = {"max_new_tokens": 10, "details": True, "decoder_input_details": True,
              "top_n_tokens": 3, "return_full_text": True}
    http = post(server, "/generate", {"inputs": "Paris is the capital of", "parameters": params})
    assert http.status_code == 200, http.text
    reply = stub.Generate(request_of("Paris is the capital of", params), metadata=AUTH, timeout=60)
    assert reply.generated_text == http.json()["generated_text"]
    assert details_json(reply.details) == http.json()["details"]


def test_every_sampling_field_samples_as_http_does(server, stub):
    params = {"max_new_tokens": 12, "do_sample": True, "seed": 7, "temperature": 0.7,
              "top_k": 40, "top_p": 0.9, "typical_p": 0.95, "repetition_penalty": 1.3,
              "frequency_penalty": 0.5, "watermark": True, "truncate": 6, "details": True,
              "stop": ["zzz"]}
    warm(server, "Once upon a time", params)
    http = post(server, "/generate", {"inputs": "Once upon a time", "parameters": params}).json()
    reply = stub.Generate(request_of("Once upon a time", params), metadata=AUTH, timeout=60)
    assert reply.generated_text == http["generated_text"]
    assert details_json(reply.details) == http["details"]
    assert reply.details.seed == 7


def test_grammar_and_best_of(server, stub):
    regex = {"max_new_tokens": 8, "grammar": {"type": "regex", "value": "[0-9]{3}"}}
    reply = stub.Generate(request_of("Digits:", regex), metadata=AUTH, timeout=60)
    assert reply.generated_text == post(server, "/generate", {
        "inputs": "Digits:", "parameters": regex}).json()["generated_text"]
    assert len(reply.generated_text) == 3 and reply.generated_text.isdigit()
    best = stub.Generate(request_of("Once upon a time", {"max_new_tokens": 4, "best_of": 2,
                                                         "do_sample": True, "details": True}),
                         metadata=AUTH, timeout=60)
    assert len(best.details.best_of_sequences) == 1
    other = best.details.best_of_sequences[0]
    assert sum(t.logprob for t in best.details.tokens) >= sum(t.logprob for t in other.tokens)


def test_stream_equals_generate(server, stub):
    params = {"max_new_tokens": 10, "details": True, "top_n_tokens": 2}
    request = request_of("Once upon a time", params)
    warm(server, "Once upon a time", params)
    whole = stub.Generate(request, metadata=AUTH, timeout=60)
    messages = list(stub.GenerateStream(request, metadata=AUTH, timeout=60))
    assert [m.index for m in messages] == list(range(1, len(messages) + 1))
    assert "".join(m.token.text for m in messages) == whole.generated_text
    assert [token_json(m.token) for m in messages] == [token_json(t) for t in whole.details.tokens]
    assert [[token_json(t) for t in m.top_tokens] for m in messages] == \
        [[token_json(t) for t in step.tokens] for step in whole.details.top_tokens]
    *middle, last = messages
    assert not any(m.HasField("generated_text") or m.HasField("details") for m in middle)
    assert last.generated_text == whole.generated_text
    assert last.details.finish_reason == whole.details.finish_reason
    assert last.details.generated_tokens == whole.details.generated_tokens == len(messages)
    assert last.details.input_length == len(post(server, "/tokenize",
                                                 {"inputs": "Once upon a time"}).json())
    # HTTP's /generate says the same for the same request
    http = post(server, "/generate", {"inputs": "Once upon a time", "parameters": params}).json()
    assert http["generated_text"] == whole.generated_text


def _free_and_total_blocks(server):
    return free_and_total_blocks(server.url)


def _dropped(server) -> float:
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('tgi_request_failure{err="dropped"}'):
            return float(line.split()[1])
    return 0.0


def test_cancelled_streams_and_deadlines_leak_nothing(server, stub):
    request = request_of("Once upon a time", {"max_new_tokens": 100, "ignore_eos": True})
    short = request_of("Once upon a time", {"max_new_tokens": 5})
    reference = stub.Generate(short, metadata=AUTH, timeout=60).generated_text
    dropped_before = _dropped(server)
    for _ in range(10):
        call = stub.GenerateStream(request, metadata=AUTH, timeout=60)
        next(call)  # mid-generation: 99 tokens to go
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request, metadata=AUTH, timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while True:
        free, total = _free_and_total_blocks(server)
        if free == total and _dropped(server) >= dropped_before + 11:
            break
        assert time.monotonic() < deadline, f"{total - free} blocks still held"
        time.sleep(0.05)
    assert stub.Generate(short, metadata=AUTH, timeout=60).generated_text == reference


def test_streams_whose_clients_stop_reading_hold_no_slot_and_end_after_the_write_timeout(
        server, stub):
    # as many streams as --max-concurrent-requests, whose clients read one message and no more,
    # through a flow-control window of 1 KB that only reading opens again
    small = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    request = request_of("Once upon a time", {"max_new_tokens": 100, "ignore_eos": True})
    channels = [grpc.insecure_channel(server.grpc_target, options=small)
                for _ in range(MAX_CONCURRENT)]
    try:
        calls = [api_pb2_grpc.TextGenerationStub(channel).GenerateStream(
            request, metadata=AUTH, timeout=60) for channel in channels]
        for call in calls:
            next(call)
        started = time.monotonic()
        # their generations run to their end and let go of their blocks and slots, while their
        # calls wait on the clients: HTTP and gRPC clients are served, not 429
        wait_until(lambda: _free_and_total_blocks(server)[0] == _free_and_total_blocks(server)[1],
                   "the generations to end", timeout=30)
        short = {"max_new_tokens": 3}
        http = post(server, "/generate", {"inputs": "Hello", "parameters": short})
        assert http.status_code == 200, http.text
        assert stub.Generate(request_of("Hello", short), metadata=AUTH, timeout=30).generated_text
        assert time.monotonic() - started < WRITE_TIMEOUT_S, "served only once the calls ended"
        # past --stream-write-timeout the calls end (the clients hear DEADLINE_EXCEEDED after
        # the messages they had not read)
        wait_until(lambda: server.log().count("GenerateStream ended: the client took no "
                                              "message") >= MAX_CONCURRENT,
                   "the calls to end", timeout=WRITE_TIMEOUT_S + 30)
        assert time.monotonic() - started > WRITE_TIMEOUT_S - 1
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert f"took no message for {WRITE_TIMEOUT_S} s (--stream-write-timeout)" in \
                err.value.details()
    finally:
        for channel in channels:
            channel.close()


BAD_FIELDS = [
    ({"temperature": 0.0}, False),
    ({"top_p": 1.5}, False),
    ({"top_k": -1}, False),
    ({"frequency_penalty": 2.5}, False),
    ({"max_new_tokens": 0}, False),
    ({"max_new_tokens": 200}, False),
    ({"truncate": 65}, False),
    ({"top_n_tokens": 6}, False),
    ({"stop": ["a", "b", "c", "d", "e"]}, False),
    ({"best_of": 2}, False),
    ({"best_of": 2, "do_sample": True, "seed": 3}, False),
    ({"adapter_id": "my-lora"}, False),
    ({"grammar": {"type": "ebnf", "value": "x"}}, False),
    ({"grammar": {"type": "json", "value": "{not json"}}, False),
    ({"best_of": 2, "do_sample": True}, True),
    ({"decoder_input_details": True}, True),
]


@pytest.mark.parametrize("params,stream", BAD_FIELDS, ids=[str(p) for p, _ in BAD_FIELDS])
def test_a_bad_field_is_invalid_argument_with_tgis_message(server, stub, params, stream):
    route = "/generate_stream" if stream else "/generate"
    http = post(server, route, {"inputs": "Hello there", "parameters": params})
    assert http.status_code == 422, http.text
    with pytest.raises(grpc.RpcError) as err:
        method = stub.GenerateStream if stream else stub.Generate
        reply = method(request_of("Hello there", params), metadata=AUTH, timeout=60)
        list(reply) if stream else reply
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == http.json()["error"]
    assert ("tgi-error-type", "validation") in err.value.trailing_metadata()


def test_an_empty_prompt_is_invalid_argument(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(api_pb2.GenerateRequest(inputs=""), metadata=AUTH, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == post(server, "/generate", {"inputs": ""}).json()["error"]


def test_embed_of_a_model_that_does_not_embed_is_failed_precondition(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(api_pb2.EmbedRequest(inputs="Hello"), metadata=AUTH, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    http = post(server, "/embed", {"inputs": "Hello"})
    assert http.status_code == 400 and err.value.details() == http.json()["error"]
    assert "does not serve embeddings" in err.value.details()


def test_tokenize_and_info_equal_http(server, stub):
    text = "café naïve 🙂 Hello world"
    reply = stub.Tokenize(api_pb2.TokenizeRequest(inputs=text), metadata=AUTH, timeout=60)
    assert [{"id": t.id, "text": t.text, "start": t.start, "stop": t.stop}
            for t in reply.tokens] == post(server, "/tokenize", {"inputs": text}).json()
    info = stub.Info(api_pb2.InfoRequest(), metadata=AUTH, timeout=60)
    http = requests.get(f"{server.url}/info", timeout=10,
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert set(http) == set(api_pb2.InfoResponse.DESCRIPTOR.fields_by_name)
    from google.protobuf.json_format import MessageToDict

    for name, value in http.items():
        if value is None:
            assert not info.HasField(name), name
        elif isinstance(value, dict):
            assert MessageToDict(getattr(info, name), preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True) == {
                k: v for k, v in value.items() if v is not None}, name
        elif isinstance(value, list) and name == "lora_adapters":
            assert [item.name for item in getattr(info, name)] == [v["name"] for v in value]
        else:
            assert getattr(info, name) == value, name


def test_health_needs_no_key_and_the_standard_service_is_serving(channel, stub):
    assert stub.Health(api_pb2.HealthRequest(), timeout=30) == api_pb2.HealthResponse()
    checker = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        reply = checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    watch = checker.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def _reflection(channel, request, metadata=AUTH):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return next(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=30))


def test_reflection_lists_and_describes_the_services(channel):
    listed = _reflection(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    described = _reflection(channel, reflection_pb2.ServerReflectionRequest(
        file_containing_symbol=SERVICE))
    assert described.file_descriptor_response.file_descriptor_proto  # what grpcurl describe reads


def test_the_api_key_is_required_but_for_health_and_reflection(server, channel, stub):
    request = request_of("Hello", {"max_new_tokens": 2})
    calls = [lambda md: stub.Generate(request, metadata=md, timeout=30),
             lambda md: list(stub.GenerateStream(request, metadata=md, timeout=30)),
             lambda md: stub.Tokenize(api_pb2.TokenizeRequest(inputs="Hi"), metadata=md,
                                      timeout=30),
             lambda md: stub.Info(api_pb2.InfoRequest(), metadata=md, timeout=30)]
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call(metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Generate(request, metadata=AUTH, timeout=30).generated_text
    assert requests.post(f"{server.url}/generate", json={"inputs": "Hello"},
                         timeout=30).status_code == 401
    # what grpcurl needs for a keyless health check: reflection describes the public proto only
    listed = _reflection(channel, reflection_pb2.ServerReflectionRequest(list_services=""),
                         metadata=())
    assert SERVICE in {s.name for s in listed.list_services_response.service}


def test_calls_are_counted_in_the_metrics(server, stub):
    def count(name: str) -> float:
        for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.split()[-1])
        return 0.0

    before = count("tgi_request_count"), count("tgi_request_success")
    stub.Generate(request_of("Hello", {"max_new_tokens": 2}), metadata=AUTH, timeout=30)
    list(stub.GenerateStream(request_of("Hello", {"max_new_tokens": 2}), metadata=AUTH,
                             timeout=30))
    assert (count("tgi_request_count"), count("tgi_request_success")) == \
        (before[0] + 2, before[1] + 2)


def test_the_readme_client_runs(server, tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("**gRPC API for internal services**"):]
    client = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    port = server.grpc_target.rsplit(":", 1)[1]
    client = client.replace("localhost:50051", f"localhost:{port}").replace("<key>", API_KEY)
    ran = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, check=False)  # the stubs as installed, not from the checkout
    assert ran.returncode == 0, ran.stderr
    # the text, a newline, then the same text streamed token by token
    out, half = ran.stdout, len(ran.stdout) // 2
    assert out and out[half] == "\n" and out[:half] == out[half + 1:]
