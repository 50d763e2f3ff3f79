"""What the health routes say, and to whom, end to end: /health and gRPC's health check agree while
the default model is stopped and started again through the models API, and without the API key
X-Model-Id tells nothing of which models exist or in which state.

Its own server: the only one with an API key, a registry and a default model the models API may
stop (named by --model-id, its files by --weights-cache-override); a tiny model starts in seconds.
"""
import re
import shutil

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import api_pb2, api_pb2_grpc
from tests.e2e.server import free_port, launch
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

KEY = {"Authorization": "Bearer access-key"}
DEFAULT = "tiny-default"
NAMES = (DEFAULT, "parked", "no-such-model")  # running (at first), pulled and stopped, unknown


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    shutil.copytree(tiny_llama, allowed / "tiny")
    grpc_port = free_port()
    launched = launch(["--model-id", DEFAULT, "--weights-cache-override", str(tiny_llama)],
                      tmp_path_factory.mktemp("access"),
                      extra=["--max-batch-total-tokens", "2048", "--block-size", "4",
                             "--api-key", KEY["Authorization"].split()[1],
                             "--grpc-port", str(grpc_port),
                             "--allowed-local-model-path", str(allowed)])
    launched.allowed = allowed
    launched.grpc_target = f"127.0.0.1:{grpc_port}"
    yield launched
    assert launched.stop() == 0, launched.log()[-5000:]
    assert launched.processes_left() == []


def _health(server, model=None, headers=None):
    named = {} if model is None else {"X-Model-Id": model}
    reply = requests.get(f"{server.url}/health", headers={**named, **(headers or {})}, timeout=10)
    return reply.status_code, reply.text, reply.headers.get("Retry-After")


def _metrics_shape(server, model=None, headers=None):
    """/metrics' status and its samples' names and labels (their values move)."""
    named = {} if model is None else {"X-Model-Id": model}
    reply = requests.get(f"{server.url}/metrics", headers={**named, **(headers or {})},
                         timeout=10)
    return reply.status_code, [re.sub(r" [^ ]+$", "", line) for line in reply.text.splitlines()]


def _move(server, model, action):
    reply = requests.put(f"{server.url}/v1/models/{model}/{action}", headers=KEY, timeout=300)
    assert reply.status_code == 200, reply.text


def _grpc_status(server):
    """(grpc.health.v1's status for "" and the service, the Health RPC's code)."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        checker = health_pb2_grpc.HealthStub(channel)
        standard = {checker.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=30).status
                    for service in ("", "tgi.v1.TextGeneration")}
        try:
            api_pb2_grpc.TextGenerationStub(channel).Health(api_pb2.HealthRequest(), timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
    return standard, code


def _generate(server, model):
    return requests.post(f"{server.url}/generate", headers={**KEY, "X-Model-Id": model},
                         timeout=60, json={"inputs": "hi", "parameters": {"max_new_tokens": 3}})


SERVING = ({health_pb2.HealthCheckResponse.SERVING}, grpc.StatusCode.OK)
NOT_SERVING = ({health_pb2.HealthCheckResponse.NOT_SERVING}, grpc.StatusCode.UNAVAILABLE)


def test_health_follows_the_default_model_and_tells_only_key_holders(server):
    pulled = requests.post(f"{server.url}/v1/models/pull", headers=KEY, timeout=10,
                           json={"model": str(server.allowed / "tiny"), "id": "parked"})
    assert pulled.status_code == 200, pulled.text
    wait_until(lambda: requests.get(f"{server.url}/v1/models/parked", headers=KEY,
                                    timeout=10).json()["state"] == "downloaded", "the pull")

    # without the key every name reads as no name; with it, the header tells
    for route in (_health, _metrics_shape):
        unnamed = route(server)
        assert unnamed[0] == 200
        for headers in (None, {"Authorization": "Bearer wrong"}):
            assert [route(server, name, headers) for name in NAMES] == [unnamed] * 3, route
    assert [_health(server, name, KEY)[0] for name in NAMES] == [200, 503, 200]
    assert [_metrics_shape(server, name, KEY)[0] for name in NAMES] == [200, 409, 200]
    assert _grpc_status(server) == SERVING

    # the default model stopped: a 503 with Retry-After, as gRPC says NOT_SERVING
    _move(server, DEFAULT, "stop")
    status, body, retry_after = unnamed = _health(server)
    assert status == 503 and retry_after is not None, body
    assert f"the default model '{DEFAULT}' is stopped" in body and "healthcheck" in body
    assert _grpc_status(server) == NOT_SERVING
    assert [_health(server, name) for name in NAMES] == [unnamed] * 3
    assert [_health(server, name, KEY)[0] for name in NAMES] == [503, 503, 503]
    assert requests.post(f"{server.url}/generate", headers=KEY, timeout=10,
                         json={"inputs": "hi"}).status_code == 409  # what the 503 spares

    # another model started serves meanwhile; running alone, it answers requests naming none,
    # and health (HTTP and gRPC alike) follows what those get
    _move(server, "parked", "start")
    assert _generate(server, "parked").status_code == 200
    assert _health(server, "parked", KEY)[0] == 200
    assert _health(server)[0] == 200 and _grpc_status(server) == SERVING
    assert _health(server, DEFAULT, KEY)[0] == 503
    _move(server, "parked", "stop")
    assert _health(server)[0] == 503 and _grpc_status(server) == NOT_SERVING

    _move(server, DEFAULT, "start")
    assert _health(server)[:2] == (200, "") and _grpc_status(server) == SERVING
    assert _generate(server, DEFAULT).status_code == 200
