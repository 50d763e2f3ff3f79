"""/health, /health_generate and gRPC's health check agree on which model they ask about, and
X-Model-Id on the public routes counts only with the API key (the real app over a scripted
shard)."""
import pytest

from router.api.grpc import service as grpc_service
from router.errors import UnhealthyError
from router.lifecycle.registry import RUNNING, STOPPED, ModelRecord
from router.state import STATE
from tests.unit.router.test_api_errors import HealthyFake, _client

KEY = {"Authorization": "Bearer s3cret"}


async def _health(client, model: str | None = None, **headers):
    named = {"X-Model-Id": model} if model is not None else {}
    reply = await client.get("/health", headers={**named, **headers})
    return reply.status, await reply.text(), reply.headers.get("Retry-After")


async def _grpc_serving(state) -> bool:
    try:
        await grpc_service.check_health(state)
    except UnhealthyError:
        return False
    return True


def _stop_default(manager):
    """The default model stopped as the models API stops it: out of `served`, recorded stopped."""
    served = manager.served.pop(manager.default_id)
    manager.registry.records[manager.default_id].state = STOPPED
    return served


async def test_health_is_503_while_the_default_model_cannot_serve(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        state = client.server.app[STATE]
        manager = state.models
        assert (await _health(client))[0] == 200 and await _grpc_serving(state)
        served = _stop_default(manager)
        status, body, retry_after = await _health(client)
        assert status == 503 and retry_after is not None
        assert '"error_type": "healthcheck"' in body and "is stopped" in body
        assert not await _grpc_serving(state)  # as gRPC says
        assert (await _health(client, manager.default_id))[0] == 503
        assert (await client.get("/health_generate")).status == 503
        # the one model that runs answers what names no model: health follows it
        manager.registry.add(ModelRecord("other", RUNNING, model_dir=str(tiny_llama)))
        manager.served["other"] = served
        assert (await _health(client))[0] == 200 and await _grpc_serving(state)
        assert (await client.post("/generate", json={"inputs": "hi"})).status == 200
        # two others run: a request naming none gets the stopped default's 409, health a 503
        manager.registry.add(ModelRecord("third", RUNNING, model_dir=str(tiny_llama)))
        manager.served["third"] = served
        assert (await client.post("/generate", json={"inputs": "hi"})).status == 409
        assert (await _health(client))[0] == 503 and not await _grpc_serving(state)
        assert (await _health(client, "other"))[0] == 200
        assert (await _health(client, "no-such-model"))[0] == 404
    finally:
        await client.close()


async def test_without_a_default_model_health_asks_whether_any_model_serves(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        served = manager.served.pop(manager.default_id)
        manager.registry.remove(manager.default_id)
        manager.default_id = None
        assert (await _health(client))[0] == 503  # nothing runs
        manager.served["a"] = manager.served["b"] = served
        assert (await _health(client))[0] == 200
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_without_the_key_x_model_id_tells_nothing(tiny_llama, path):
    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    try:
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("parked", STOPPED, model_dir="/nowhere"))
        manager.registry.add(ModelRecord("running", RUNNING, model_dir=str(tiny_llama)))
        manager.served["running"] = manager.default  # two run: names matter

        async def ask(model, headers):
            reply = await client.get(path, headers={"X-Model-Id": model, **headers})
            return reply.status, await reply.text()

        names = (manager.default_id, "running", "parked", "no-such-model")
        anonymous = {await ask(name, {}) for name in names}
        wrong_key = {await ask(name, {"Authorization": "Bearer nope"}) for name in names}
        unnamed = await client.get(path)
        assert anonymous == wrong_key == {(unnamed.status, await unnamed.text())}
        # with the key the header tells
        told = [(await ask(name, KEY))[0] for name in names]
        assert told == [200, 200, 503 if path == "/health" else 409, 404]
    finally:
        await client.close()


async def test_on_the_prometheus_port_too(tiny_llama):
    from aiohttp.test_utils import TestClient, TestServer

    from router.api.tgi.routes import metrics_app

    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    try:
        state = client.server.app[STATE]
        state.models.registry.add(ModelRecord("parked", STOPPED, model_dir="/nowhere"))
        port = TestClient(TestServer(metrics_app(state)))
        await port.start_server()
        try:
            anonymous = await port.get("/metrics", headers={"X-Model-Id": "parked"})
            assert anonymous.status == 200
            keyed = await port.get("/metrics", headers={"X-Model-Id": "parked", **KEY})
            assert keyed.status == 409
        finally:
            await port.close()
    finally:
        await client.close()
