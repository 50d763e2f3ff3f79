"""The model routes and routing by name, with the real app over a scripted shard (no launcher)."""
from router.lifecycle.registry import STOPPED, ModelRecord
from router.state import STATE
from tests.unit.router.test_api_errors import HealthyFake, _client

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_one_model_answers_any_name_and_two_make_names_matter(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/chat/completions", json={**CHAT, "model": "anything"})
        assert reply.status == 200, await reply.text()
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("org/other", STOPPED, model_dir="/nowhere"))
        # a model merely on disk does not change how a one-model server answers
        reply = await client.post("/v1/chat/completions", json={**CHAT, "model": "anything"})
        assert reply.status == 200, await reply.text()
        manager.served["org/second"] = manager.default  # a second model running

        unknown = await client.post("/v1/chat/completions", json={**CHAT, "model": "anything"})
        assert unknown.status == 404
        assert (await unknown.json())["error_type"] == "model_not_found"
        stopped = await client.post("/v1/chat/completions", json={**CHAT, "model": "org/other"})
        assert stopped.status == 409 and "stopped" in (await stopped.json())["error"]
        for unnamed in ({}, {"model": "tgi"}, {"model": ""}):
            reply = await client.post("/v1/chat/completions", json={**CHAT, **unnamed})
            assert reply.status == 200, unnamed
        sglang = await client.post("/generate", headers={"X-Model-Id": "org/other"},
                                   json={"text": "hi"})
        assert sglang.status == 409 and "message" in (await sglang.json())["error"]
        tgi = await client.post("/generate", headers={"X-Model-Id": "org/other"},
                                json={"inputs": "hi"})
        assert tgi.status == 409
        assert (await client.post("/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 2}})).status == 200
    finally:
        await client.close()


async def test_ids_raw_and_percent_encoded_reach_the_same_model(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("org/other", STOPPED, model_dir="/nowhere"))
        for path in ("/v1/models/org/other", "/v1/models/org%2Fother"):
            reply = await client.get(path)
            assert reply.status == 200, path
            assert (await reply.json())["id"] == "org/other"
        for path in ("/v1/models/org%252Fother", "/v1/models/..%2F..%2Fetc",
                     "/v1/models/%2E%2E"):
            assert (await client.get(path)).status in (400, 404), path
        for path in ("/v1/models/org%252Fother", "/v1/models/..%2F..%2Fetc"):
            assert (await client.get(path)).status == 400, path  # refused by the id check
        listed = await (await client.get("/v1/models")).json()
        assert {m["id"] for m in listed["data"]} == {tiny_llama.name, "org/other"}
        # without tgi-launcher nothing can start; a stopped model's stop is idempotent
        start = await client.put("/v1/models/org/other/start")
        assert start.status == 503 and (await start.json())["error_type"] == "model_host"
        stop = await client.post("/v1/models/stop", json={"model": "org/other"})
        assert (await stop.json()) == {"id": "org/other", "object": "model", "state": "stopped"}
        pull = await client.post("/v1/models/pull", json={"model": "/somewhere/x"})
        assert pull.status == 503
        deleted = await client.delete("/v1/models/org%2Fother")
        assert (await deleted.json())["deleted"] is True
        assert (await client.get("/v1/models/org/other")).status == 404
    finally:
        await client.close()


async def test_patch_changes_request_defaults_of_a_running_model(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        default = manager.default
        manager.registry.add(ModelRecord("served", "running", model_dir=str(tiny_llama)))
        manager.served["served"] = default
        reply = await client.patch("/v1/models/served", json={"parameters": {"token_limit": 3}})
        assert reply.status == 200, await reply.text()
        assert default.request_defaults == {"token_limit": 3}
        # null removes a key; an unknown one is a 422 either way, never a silent no-op
        for value in (None, 5):
            wrong = await client.patch("/v1/models/served",
                                       json={"parameters": {"no_such_key": value}})
            assert wrong.status == 422, await wrong.text()
            assert "no_such_key" in (await wrong.json())["error"]
        chat = await client.post("/v1/chat/completions", json={
            "model": "served", "messages": [{"role": "user", "content": "hi"}]})
        assert (await chat.json())["usage"]["completion_tokens"] == 3
        # a default past the model's context is trimmed to the room the prompt leaves, as the
        # route's own default is, never a 422
        reply = await client.patch("/v1/models/served",
                                   json={"parameters": {"token_limit": 1_000_000}})
        assert reply.status == 200, await reply.text()
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                                     "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            reply = await client.post(path, json={"model": "served", **body})
            assert reply.status == 200, (path, await reply.text())
        conflict = await client.delete("/v1/models/served")
        body = await conflict.json()
        assert conflict.status == 409 and body["state"] == "running"
    finally:
        await client.close()


async def test_metrics_of_several_models_are_labelled_and_one_model_is_unchanged(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        alone = await (await client.get("/metrics")).text()
        assert "tgi_request_count 0" in alone and "model=" not in alone
        manager.served["second"] = manager.default
        both = await (await client.get("/metrics")).text()
        assert both.count("# HELP tgi_request_count ") == 1
        assert f'tgi_request_count{{model="{tiny_llama.name}"}} 0' in both
        assert 'tgi_request_count{model="second"} 0' in both
        assert both.count("# HELP tgi_request_failure ") == 1  # one family, not one per model
        assert 'tgi_request_failure' in both and 'tgi_request_duration_bucket{model="second",' in both
        named = await (await client.get("/metrics", headers={"X-Model-Id": "second"})).text()
        assert named == alone
        manager.served.clear()  # nothing running: an empty exposition, not an error
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_a_request_that_reaches_a_stopped_model_gets_a_409(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        default = client.server.app[STATE].models.default
        await default.close()  # as a stop does once the model's requests have drained
        reply = await client.post("/generate", json={"inputs": "hi"})
        assert reply.status == 409 and "stopped" in (await reply.json())["error"]
    finally:
        await client.close()


async def test_pull_and_start_bodies_are_checked(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        for body in ({"model": "a\x00b"}, {"model": "x" * 5000}, {"model": 3}, {"model": "m", "id": "../x"},
                     {"model": "m", "colour": 1}, {"model": "x" * 5000, "id": "ok"},
                     {"model": "a\x00b", "id": "ok"}):
            reply = await client.post("/v1/models/pull", json=body)
            assert reply.status in (400, 422), (body, reply.status)
        manager = client.server.app[STATE].models
        manager.registry.add(ModelRecord("other", STOPPED, model_dir="/nowhere"))
        bad = await client.post("/v1/models/start", json={"model": "other", "ctx_len": "--5"})
        assert bad.status == 422
        unknown = await client.post("/v1/models/start", json={"model": "other", "colour": 2})
        assert unknown.status == 422
        stop = await client.post("/v1/models/stop", json={"model": "other", "force": True})
        assert stop.status == 422
        # the settings are kept; without tgi-launcher nothing starts
        # this server's own settings too, flat as a start's body has always taken them
        start = await client.post("/v1/models/start", json={"model": "other", "ctx_len": 64,
                                                            "cpu_threads": 2, "num_shard": 2})
        assert start.status == 503
        assert manager.registry.get("other").settings == {"ctx_len": 64, "cpu_threads": 2,
                                                          "num_shard": 2}
    finally:
        await client.close()


async def test_while_one_model_runs_any_name_reaches_it_even_when_it_is_not_the_default(
        tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        manager = client.server.app[STATE].models
        served = manager.served.pop(manager.default_id)  # the default stopped, "other" runs
        manager.registry.add(ModelRecord("other", "running", model_dir=str(tiny_llama)))
        manager.served["other"] = served
        assert manager.served_model(None) is served
        assert manager.served_model("no-such-model") is served
        reply = await client.post("/generate", json={"inputs": "hi",
                                                     "parameters": {"max_new_tokens": 2}})
        assert reply.status == 200, await reply.text()
    finally:
        await client.close()


def test_a_model_label_is_escaped_as_prometheus_reads_it():
    from router.telemetry.metrics import _labelled

    assert _labelled('tgi_x{a="b"} 1', 'C:\\m"1') == 'tgi_x{model="C:\\\\m\\"1",a="b"} 1'
    assert _labelled("tgi_y 2", "plain") == 'tgi_y{model="plain"} 2'
