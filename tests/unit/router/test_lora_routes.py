"""LoRA adapters over HTTP with the real app over a scripted shard: vLLM's load and unload routes,
the /v1/models routes, /info, /metrics, and the adapters given at start (--lora-adapters)."""
from urllib.parse import quote

import pytest

from router.app import load_startup_adapters
from router.errors import UnknownAdapterError, ValidationError
from router.state import STATE
from tests.unit.router.adapter_helpers import make_adapter_dir
from tests.unit.router.test_api_errors import HealthyFake, _client


async def _load(client, name, path, **extra):
    return await client.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": str(path), **extra})


async def test_vllm_routes_load_list_and_unload_an_adapter(tiny_llama, tmp_path):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        path = make_adapter_dir(tmp_path, "sql")
        reply = await _load(client, "sql-lora", path)
        assert reply.status == 200
        assert await reply.text() == "Success: LoRA adapter 'sql-lora' added successfully."
        assert fake.adapters == {"sql-lora": str(path.resolve())}

        listed = (await (await client.get("/v1/models")).json())["data"]
        item = next(m for m in listed if m["id"] == "sql-lora")
        assert {k: item[k] for k in ("object", "owned_by", "root", "parent", "type", "state")} \
            == {"object": "model", "owned_by": "tgi-py", "root": str(path),
                "parent": tiny_llama.name, "type": "lora", "state": "running"}
        assert item["metadata"]["rank"] == 8 and item["assets"] == [str(path.resolve())]
        assert await (await client.get("/v1/models/sql-lora")).json() == item
        info = await (await client.get("/info")).json()
        assert [a["name"] for a in info["lora_adapters"]] == ["sql-lora"]
        assert info["lora_adapters"][0]["parent"] == tiny_llama.name

        again = await _load(client, "sql-lora", path)
        assert again.status == 400
        assert (await again.json())["error"]["message"] == \
            "The lora adapter 'sql-lora' has already been loaded."

        reply = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
        assert reply.status == 200
        assert await reply.text() == "Success: LoRA adapter 'sql-lora' removed successfully."
        assert fake.adapters == {}
        assert (await (await client.get("/info")).json())["lora_adapters"] == []
        listed = (await (await client.get("/v1/models")).json())["data"]
        assert "sql-lora" not in {m["id"] for m in listed}
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
        assert gone.status == 404
        error = (await gone.json())["error"]
        assert error["http_status_code"] == 404 and "'sql-lora' is not loaded" in error["message"]
    finally:
        await client.close()


async def test_a_local_adapter_loads_only_from_the_allowed_directories(tiny_llama, tmp_path):
    """Outside --allowed-local-model-path every path gets one answer, whether an adapter is
    there or nothing is; --lora-adapters, the operator's own, load from anywhere."""
    fake = HealthyFake()
    allowed = tmp_path / "allowed"
    client = await _client(tiny_llama, fake, allowed_local_model_path=str(allowed))
    try:
        outside = make_adapter_dir(tmp_path / "elsewhere", "real")
        (allowed / "link").parent.mkdir(parents=True)
        (allowed / "link").symlink_to(outside)
        linked_files = allowed / "files"  # a directory inside whose files lead out
        linked_files.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (linked_files / name).symlink_to(outside / name)
        messages = set()
        for path in (outside, tmp_path / "missing", allowed / "link", f"{allowed}/../elsewhere",
                     f"{allowed}-evil", "/etc", linked_files):
            reply = await _load(client, "x", path)
            assert reply.status == 400
            messages.add((await reply.json())["error"]["message"])
        assert messages == {"`lora_path` names a local path this server may not load adapters "
                            "from: a local adapter is loaded only from under the directories its "
                            "operator allows (--allowed-local-model-path)"}
        assert fake.adapters == {}
        inside = make_adapter_dir(allowed, "ok")
        assert (await _load(client, "ok", inside)).status == 200
        state = client.server.app[STATE]
        await state.models.default.adapters.load("operators", str(outside), operator=True)
        assert set(fake.adapters) == {"ok", "operators"}
    finally:
        await client.close()


@pytest.mark.parametrize("body, status, words", [
    ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "x", "lora_path": "/tmp/no/such/dir"}, 400, "no adapter directory"),
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "may not load adapters from"),
    ({"lora_name": "x", "lora_path": "org/x"}, 400, "need tgi-launcher's model host"),
    ({"lora_name": "a\"b", "lora_path": "/tmp"}, 400, "invalid adapter name"),
    ({"lora_name": "x", "lora_path": "/tmp", "load_inplace": True}, 400, "`load_inplace`"),
    ({"lora_name": "x", "lora_path": "/tmp", "model": "other"}, 404, "not found"),
])
async def test_bad_loads_are_4xx_in_openai_shape_and_change_nothing(tiny_llama, body, status,
                                                                    words):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        client.server.app[STATE].models.served["other-model"] = \
            client.server.app[STATE].models.default  # two run: `model` must name one
        reply = await client.post("/v1/load_lora_adapter", json=body)
        assert reply.status == status
        error = (await reply.json())["error"]
        assert words in error["message"] and error["http_status_code"] == status
        assert fake.adapters == {}
    finally:
        await client.close()


async def test_an_adapter_the_shards_refuse_is_a_400_with_their_reason(tiny_llama, tmp_path):
    fake = HealthyFake()
    fake.refuse_adapter = lambda name, path: "base model 'other/model' does not match"
    client = await _client(tiny_llama, fake)
    try:
        reply = await _load(client, "a", make_adapter_dir(tmp_path))
        assert reply.status == 400
        assert "does not match" in (await reply.json())["error"]["message"]
        assert (await client.get("/v1/models/a")).status == 404
    finally:
        await client.close()


async def test_adapters_and_models_share_one_namespace(tiny_llama, tmp_path):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        path = make_adapter_dir(tmp_path)
        reply = await _load(client, tiny_llama.name, path)
        assert reply.status == 400 and "is the id of a model" in await reply.text()
        assert (await _load(client, "lora-a", path)).status == 200
        pull = await client.post("/v1/models/pull", json={"model": "/x", "id": "lora-a"})
        assert pull.status == 400 and "name of a LoRA adapter" in await pull.text()
        manager = client.server.app[STATE].models
        assert manager.adapter_model("lora-a")[1] == "lora-a"
        assert manager.adapter_model(tiny_llama.name) is None
    finally:
        await client.close()


async def test_cortex_model_routes_load_and_unload_an_adapter(tiny_llama, tmp_path):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        path = make_adapter_dir(tmp_path)
        start = await client.post("/v1/models/start", json={
            "model": "jan-lora", "lora_path": str(path), "parent": tiny_llama.name})
        assert start.status == 200, await start.text()
        assert await start.json() == {"id": "jan-lora", "object": "model", "state": "running",
                                      "parent": tiny_llama.name}
        again = await client.post("/v1/models/start", json={"model": "jan-lora"})
        assert (await again.json())["state"] == "running"
        stop = await client.post("/v1/models/stop", json={"model": "jan-lora"})
        assert await stop.json() == {"id": "jan-lora", "object": "model", "state": "stopped"}
        assert fake.adapters == {}
        await client.post("/v1/models/start", json={"model": "b", "source": str(path)})
        deleted = await client.delete("/v1/models/b")
        assert (await deleted.json())["deleted"] is True and fake.adapters == {}
        # TGI names an adapter given as a directory by that directory: no model id, all the same
        await client.post("/v1/models/start", json={"model": str(path), "lora_path": str(path)})
        encoded = quote(str(path), safe="")
        assert (await client.get(f"/v1/models/{encoded}")).status == 200
        stopped = await client.put(f"/v1/models/{encoded}/stop")
        assert (await stopped.json())["state"] == "stopped" and fake.adapters == {}
        bad = await client.post("/v1/models/start", json={"model": "c", "lora_path": 3})
        assert bad.status == 400 and (await bad.json())["error_type"] == "adapter"
    finally:
        await client.close()


async def test_metrics_show_the_loaded_adapters(tiny_llama, tmp_path):
    client = await _client(tiny_llama, HealthyFake())
    try:
        await _load(client, "a", make_adapter_dir(tmp_path))
        text = await (await client.get("/metrics")).text()
        assert "tgi_lora_adapters_loaded 1.0" in text
    finally:
        await client.close()


async def test_adapters_given_at_start_are_loaded_and_a_bad_one_stops_the_router(
        tiny_llama, tmp_path):
    client = await _client(tiny_llama, HealthyFake())
    try:
        state = client.server.app[STATE]
        good = make_adapter_dir(tmp_path, "good")
        state.config.lora_adapters = f"first={good}, {good}"
        await load_startup_adapters(state)
        assert state.models.default.adapters.names() == ["first", "good"]
        state.config.lora_adapters = f"third={tmp_path / 'missing'}"
        with pytest.raises(ValueError, match="--lora-adapters third=.*no adapter directory"):
            await load_startup_adapters(state)
    finally:
        await client.close()


def test_the_flag_s_syntax_is_checked_at_start(tiny_llama):
    from router.config.server import ServerSettings
    config = ServerSettings(lora_adapters="a=/x/a,/y/b/,")
    assert config.lora_adapter_dirs() == [("a", "/x/a"), ("b", "/y/b/")]
    for bad, words in (("a=", "write name=/path"), ("a=/x,a=/y", "names 'a' twice")):
        with pytest.raises(ValueError, match=words):
            ServerSettings(lora_adapters=bad)


async def test_max_loras_bounds_the_adapters_a_model_holds(tiny_llama, tmp_path):
    """Past --max-loras a load is a 400 in OpenAI's shape that asks nothing of the shards; one
    being unloaded still holds its place until it is gone; then a load succeeds."""
    fake = HealthyFake()
    client = await _client(tiny_llama, fake, max_loras=2)
    try:
        path = make_adapter_dir(tmp_path, "a")
        for name in ("one", "two"):
            assert (await _load(client, name, path)).status == 200
        refused = await _load(client, "three", path)
        assert refused.status == 400
        error = (await refused.json())["error"]
        assert error["message"] == ("adapter 'three' cannot be loaded: " f"{tiny_llama.name} "
                                    "holds 2 LoRA adapters, the most --max-loras (2) allows; "
                                    "unload one first (POST /v1/unload_lora_adapter)")
        assert set(fake.adapters) == {"one", "two"}
        reply = await client.post("/v1/unload_lora_adapter", json={"lora_name": "one"})
        assert reply.status == 200
        assert (await _load(client, "three", path)).status == 200
        assert set(fake.adapters) == {"two", "three"}
    finally:
        await client.close()


def test_more_adapters_at_start_than_max_loras_is_refused_at_start(tiny_llama):
    from launcher.router_flags import check_router_flags
    from router.config import router_config

    with pytest.raises(ValueError, match=r"names 3 adapters, more than --max-loras \(2\)"):
        router_config({"tokenizer_path": str(tiny_llama), "max_loras": 2,
                       "lora_adapters": "a=/x,b=/y,c=/z"})
    with pytest.raises(ValueError, match=r"more than --max-loras \(16\) lets the model hold"):
        check_router_flags({}, adapters=17)
    check_router_flags({"max_loras": 17}, adapters=17)
    with pytest.raises(ValueError, match="--max-loras -1 must be >= 0"):
        check_router_flags({"max_loras": -1})


async def test_a_session_keeps_its_adapter_and_a_call_naming_another_is_a_422(tiny_llama,
                                                                            tmp_path):
    client = await _client(tiny_llama, HealthyFake())
    try:
        served = client.server.app[STATE].models.default
        await served.adapters.load("a", str(make_adapter_dir(tmp_path)))
        session = served.sessions.begin(("", "chat"), "hi")
        session.token_ids, session.adapter_id = [1, 2], "a"  # as its first call left it
        assert served.sessions.adapter_for(session, None) == "a"
        assert served.sessions.adapter_for(session, "a") == "a"
        with pytest.raises(ValidationError, match="'chat' was started with adapter 'a'; a call "
                                                  "cannot change its adapter"):
            served.sessions.adapter_for(session, "b")
        with pytest.raises(ValidationError, match="started with adapter 'a'"):
            served.sessions.adapter_for(session, "", named=True)
        fresh = served.sessions.begin(("", "new"), "hi")
        with pytest.raises(UnknownAdapterError):
            served.sessions.adapter_for(fresh, "b")
        assert served.sessions.adapter_for(fresh, "") is None
    finally:
        await client.close()
