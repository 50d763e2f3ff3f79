"""LoRA adapters on the router's side: the registry (load, refuse, unload after the adapter's
requests, reload after a restart), the shard client's fan-out, prefix-cache and session
isolation by adapter, and the per-adapter metrics. Over the scripted shard: no model."""
import asyncio
from collections import Counter

import pytest

from proto import generate_pb2 as pb
from router.config.model import ModelSettings
from router.core.generation import Infer
from router.errors import AdapterError, UnknownAdapterError
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.accounting import kv_accounting
from router.kv.prefix_cache import PrefixCache
from router.kv.sessions import SessionAdapterConflict, SessionStore
from router.lifecycle.adapters import AdapterLinks, AdapterStore
from router.lifecycle.served_model import recovery_policy
from router.scheduler.batcher import Batcher
from router.scheduler.policy import SchedulingLimits
from router.scheduler.request_queue import QueueEntry, RequestQueue
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.shards import convert
from router.shards.client import ShardedClient, ShardError
from router.shards.step_types import ShardRequest
from router.inputs.validation import TokenLimits
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient
from tests.unit.router.adapter_helpers import make_adapter_dir
from tests.waiting import wait_until_async


def _stack(fake: FakeShardClient, links: AdapterLinks = AdapterLinks(), **store):
    kv = kv_accounting(64, 4, prefix_caching=True)
    batcher = None
    metrics = Metrics(max_input_tokens=32, max_total_tokens=64,
                      adapter_requests=lambda: batcher.requests_by_adapter())
    batcher = Batcher(fake, RequestQueue(kv.allocator, kv.prefix_cache), kv.allocator,
                      SchedulingLimits(256, 200, 0.3, 20, None), metrics, sessions=kv.sessions)
    infer = Infer(batcher, metrics, max_concurrent_requests=8)
    registry = AdapterStore(fake, infer.adapters, batcher, metrics, parent="base", links=links,
                            **store)
    return registry, infer, batcher, metrics


def _request(adapter_id=None, max_new_tokens=3, ids=(1, 2, 3, 4, 5)) -> GenerateRequest:
    return GenerateRequest(inputs="x", input_ids=list(ids), sampling=SamplingParams(),
                           stopping=StoppingParams(max_new_tokens=max_new_tokens),
                           adapter_id=adapter_id)


async def test_a_loaded_adapter_is_listed_checked_and_found_by_its_path(tmp_path):
    fake = FakeShardClient()
    registry, infer, _, metrics = _stack(fake)
    with pytest.raises(UnknownAdapterError, match="no LoRA adapters are loaded") as refused:
        registry.check("a")
    assert isinstance(refused.value, LookupError) and refused.value.status == 422
    path = make_adapter_dir(tmp_path, "a")
    entry = await registry.load("a", str(path))
    assert (entry.rank, entry.alpha, entry.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    assert fake.adapters == {"a": str(path.resolve())}
    registry.check("a")
    with pytest.raises(UnknownAdapterError, match="'b' is not loaded; the loaded adapters are: a"):
        registry.check("b")
    assert registry.names() == ["a"]
    assert registry.resolve_path(str(path)) == "a"
    assert registry.resolve_path(str(tmp_path / "a" / ".." / "a")) == "a"
    assert registry.resolve_path(str(tmp_path / "other")) is None
    assert registry.info_json()[0] | {"created": 0} == {
        "name": "a", "parent": "base", "source": str(path), "path": str(path.resolve()),
        "rank": 8, "alpha": 16.0, "scaling": 2.0, "target_modules": ["q_proj", "v_proj"],
        "base_model": "tiny", "created": 0}
    assert "tgi_lora_adapters_loaded 1.0" in metrics.render().decode()


@pytest.mark.parametrize("files, reason", [
    (None, "no adapter directory"), ({"adapter_model.safetensors"}, "no adapter_config.json"),
    ({"adapter_config.json"}, "no adapter weights")])
async def test_a_directory_without_an_adapter_is_refused_before_any_shard_call(
        tmp_path, files, reason):
    fake = FakeShardClient()
    registry, *_ = _stack(fake)
    path = tmp_path / "x"
    if files is not None:
        path.mkdir()
        for name in files:
            (path / name).write_text("{}")
    with pytest.raises(AdapterError, match=reason) as refused:
        await registry.load("x", str(path))
    assert refused.value.status == 400
    assert fake.calls == [] and registry.names() == []


async def test_names_in_use_and_bad_names_are_refused(tmp_path):
    fake = FakeShardClient()
    registry, *_ = _stack(fake)
    path = str(make_adapter_dir(tmp_path))
    await registry.load("a", path)
    with pytest.raises(AdapterError, match="The lora adapter 'a' has already been loaded."):
        await registry.load("a", path)
    for bad in ("", " a", "tgi", 'a"b', "a\\b", "x" * 513, "a\nb"):
        with pytest.raises(AdapterError, match="invalid adapter name"):
            await registry.load(bad, path)
    await registry.load("/adapters/as/tgi/names/them", path)  # TGI: a directory is its name
    taken, *_ = _stack(fake, AdapterLinks(
        name_taken=lambda name: "the id of a model" if name == "base" else None))
    with pytest.raises(AdapterError, match="'base' is the id of a model"):
        await taken.load("base", path)
    assert fake.adapters.keys() == {"a", "/adapters/as/tgi/names/them"}


async def test_an_adapter_the_shard_refuses_changes_nothing(tmp_path):
    fake = FakeShardClient()
    fake.refuse_adapter = lambda name, path: "rank 128 exceeds the largest rank, 64"
    registry, *_ = _stack(fake)
    with pytest.raises(AdapterError, match="rank 128 exceeds") as refused:
        await registry.load("a", str(make_adapter_dir(tmp_path)))
    assert refused.value.status == 400
    assert registry.names() == [] and fake.adapters == {}
    with pytest.raises(UnknownAdapterError):
        registry.check("a")


async def test_a_hub_id_needs_the_model_host_and_is_loaded_from_what_it_fetched(tmp_path):
    fake = FakeShardClient()
    registry, *_ = _stack(fake)
    with pytest.raises(AdapterError, match="need tgi-launcher's model host"):
        await registry.load("hub", "org/adapter@v1")
    fetched = []

    async def fetch(hub_id, revision, max_bytes):
        fetched.append((hub_id, revision, max_bytes))
        return str(make_adapter_dir(tmp_path, "fetched"))

    registry, *_ = _stack(fake, AdapterLinks(fetch=fetch), max_files_bytes=5 << 20)
    entry = await registry.load("hub", "org/adapter@v1")
    assert fetched == [("org/adapter", "v1", 5 << 20)], "the shards' bound goes to the fetch"
    assert entry.source == "org/adapter@v1" and entry.path.endswith("fetched")
    untakeable, *_ = _stack(fake, AdapterLinks(fetch=fetch), max_files_bytes=0)
    with pytest.raises(AdapterError, match="base's layers take no LoRA adapters"):
        await untakeable.load("none", "org/adapter")
    assert len(fetched) == 1, "nothing fetched for a model no adapter fits"

    async def failing(hub_id, revision, max_bytes):
        raise RuntimeError("404 Client Error: repository not found")

    registry, *_ = _stack(fake, AdapterLinks(fetch=failing))
    with pytest.raises(AdapterError, match="fetching adapter 'org/missing' failed: 404"):
        await registry.load("missing", "org/missing")


async def test_unload_refuses_new_requests_at_once_and_waits_for_those_in_flight(tmp_path):
    fake = FakeShardClient(step_delay=0.01)
    registry, infer, batcher, _ = _stack(fake)
    loop = asyncio.create_task(batcher.run())
    try:
        await registry.load("a", str(make_adapter_dir(tmp_path)))
        running = asyncio.create_task(infer.generate(_request("a", max_new_tokens=8)))
        await wait_until_async(lambda: batcher.requests_by_adapter()[1]["a"], "a request on a")
        unload = asyncio.create_task(registry.unload("a"))
        await wait_until_async(lambda: "a" not in infer.adapters.names(), "a closed")
        with pytest.raises(UnknownAdapterError):
            await infer.generate(_request("a"))
        assert not unload.done() and "a" in fake.adapters, "the running request still uses it"
        result = await running
        assert result.final.generated_tokens == 8
        await unload
        assert fake.adapters == {} and registry.names() == []
        assert ("unload_adapter", "a") in fake.calls
        with pytest.raises(UnknownAdapterError, match="no LoRA adapters are loaded"):
            await registry.unload("a")
    finally:
        loop.cancel()


async def test_the_shards_get_the_adapter_and_a_request_on_an_unknown_one_fails_alone(tmp_path):
    fake = FakeShardClient()
    registry, infer, batcher, _ = _stack(fake)
    loop = asyncio.create_task(batcher.run())
    try:
        await registry.load("a", str(make_adapter_dir(tmp_path)))
        results = await asyncio.gather(infer.generate(_request("a")), infer.generate(_request()))
        assert [r.final.generated_tokens for r in results] == [3, 3]
        sent = {r.request.adapter_id for r in fake.requests.values()}
        assert sent == {"a", None}
        # the router and the shard disagree (a shard restarted without it): only it fails
        del fake.adapters["a"]
        outcomes = await asyncio.gather(infer.generate(_request("a")), infer.generate(_request()),
                                        return_exceptions=True)
        assert "adapter 'a' is not loaded" in str(outcomes[0])
        assert outcomes[1].final.generated_tokens == 3
    finally:
        loop.cancel()


async def test_a_restarted_group_gets_every_adapter_again_before_serving(tmp_path):
    fake = FakeShardClient()
    registry, *_ = _stack(fake)
    await registry.load("a", str(make_adapter_dir(tmp_path, "a")))
    await registry.load("b", str(make_adapter_dir(tmp_path, "b")))
    fake.adapters.clear()  # a new shard process has none
    fake.refuse_adapter = lambda name, path: "files gone" if name == "b" else None
    await registry.reload_all()
    assert fake.adapters.keys() == {"a"}
    assert registry.names() == ["a"], "one the new group refuses is no longer served"
    with pytest.raises(UnknownAdapterError):
        registry.check("b")
    await registry.reload_all()  # loaded already (ALREADY_EXISTS): nothing to do
    assert fake.adapters.keys() == {"a"}


class _RestartingClient(FakeShardClient):
    """What recovery_policy's reconnect calls on a restarted group."""

    async def reconnect(self, socket, timeout):
        self.calls.append(("reconnect", socket))

    async def warmup(self, batch, **limits):
        self.calls.append(("warmup", None))
        return 32

    async def is_same_group_alive(self):
        return True


async def test_the_recovery_reloads_adapters_after_the_warm_up():
    fake = _RestartingClient()
    reloaded = []

    async def reload():
        reloaded.append([name for name, _ in fake.calls])

    limits = TokenLimits(max_input_tokens=8, max_total_tokens=16, max_batch_prefill_tokens=16)
    policy = recovery_policy(fake, ModelSettings(tokenizer_path="."), limits,
                             BlockAllocator(BlockPool(32, 4)), reload)
    assert await policy.reconnect() == 32
    assert reloaded == [["reconnect", "clear", "warmup"]]


class _Rank:
    """One rank's client, answering adapter calls as scripted."""

    def __init__(self, load_error: ShardError | None = None, unload_error=None):
        self.load_error, self.unload_error = load_error, unload_error
        self.calls = []

    async def call(self, method, message, timeout=None, metadata=None):
        self.calls.append((method, message.name))
        if method == "LoadAdapter":
            if self.load_error is not None:
                raise self.load_error
            return pb.LoadAdapterResponse(rank=4, alpha=8, scaling=2, target_modules=["q_proj"],
                                          base_model="m")
        if self.unload_error is not None:
            raise self.unload_error
        return pb.UnloadAdapterResponse()


async def test_a_load_one_rank_refuses_is_undone_on_the_ranks_that_took_it():
    ranks = [_Rank(), _Rank(ShardError("q_proj is not in this model", "INVALID_ARGUMENT")),
             _Rank()]
    client = ShardedClient(ranks)
    with pytest.raises(ShardError, match="q_proj is not in") as refused:
        await client.load_adapter("a", "/adapters/a")
    assert refused.value.code == "INVALID_ARGUMENT"
    assert [r.calls for r in ranks] == [[("LoadAdapter", "a"), ("UnloadAdapter", "a")],
                                        [("LoadAdapter", "a")],
                                        [("LoadAdapter", "a"), ("UnloadAdapter", "a")]]
    ok = ShardedClient([_Rank(), _Rank()])
    info = await ok.load_adapter("a", "/adapters/a")
    assert info == convert.AdapterInfo(4, 8.0, 2.0, ("q_proj",), "m")


async def test_an_unload_passes_over_a_rank_that_has_not_the_adapter():
    await ShardedClient([_Rank(), _Rank(unload_error=ShardError("no", "NOT_FOUND"))]
                        ).unload_adapter("a")
    busy = ShardedClient([_Rank(unload_error=ShardError("in use", "FAILED_PRECONDITION"))])
    with pytest.raises(ShardError, match="in use"):
        await busy.unload_adapter("a")


def test_the_shard_message_carries_the_adapter_and_the_base_model_none():
    on_adapter = convert.request_message(ShardRequest(1, _request("a"), blocks=[1]))
    assert on_adapter.HasField("adapter_id") and on_adapter.adapter_id == "a"
    base = convert.request_message(ShardRequest(2, _request(), blocks=[1]))
    assert not base.HasField("adapter_id")


# ---- caches ------------------------------------------------------------------------------------

def test_a_cached_prefix_is_reused_only_by_requests_of_the_same_adapter():
    pool = BlockPool(40, 4)
    cache = PrefixCache(pool)
    allocator = BlockAllocator(pool, [cache.evict])
    prompt = list(range(12))
    base, on_a = allocator.allocate(12), allocator.allocate(12)
    cache.insert(prompt, base.block_ids)
    cache.insert(prompt, on_a.block_ids, adapter_id="a")
    assert len(cache) == 6
    assert cache.match(prompt) == base.block_ids
    assert cache.match(prompt, adapter_id="a") == on_a.block_ids
    assert cache.match(prompt, adapter_id="b") == []
    pool.decref(base.block_ids + on_a.block_ids)  # the matches' references
    # the base model's chain is what it always was: seeded with nothing
    assert next(cache._keys(prompt, None))[0] == hash((None, tuple(range(4))))
    allocator.free(base)
    allocator.free(on_a)
    cache.forget_adapter("a")
    assert len(cache) == 3 and cache.match(prompt, adapter_id="a") == []
    cache.evict(10)
    assert allocator.num_free_blocks == allocator.num_usable_blocks, "no block leaked"


def test_the_queue_plans_a_request_with_its_adapter_s_prefix_only():
    pool = BlockPool(40, 4)
    cache = PrefixCache(pool)
    allocator = BlockAllocator(pool, [cache.evict])
    queue = RequestQueue(allocator, cache)
    prompt = list(range(12))
    computed = allocator.allocate(12)
    cache.insert(prompt, computed.block_ids, adapter_id="a")
    allocator.free(computed)
    for i, adapter in enumerate((None, "b", "a")):
        queue.append(QueueEntry(id=i, input_length=12, max_new_tokens=4, prompt_ids=prompt,
                                adapter_id=adapter))
    plan = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                            token_budget=100)
    assert [e.cache_len for e in plan.entries] == [0, 0, 8]


def test_a_session_continues_with_its_adapter_and_refuses_another():
    pool = BlockPool(20, 4)
    store = SessionStore(pool)
    allocator = BlockAllocator(pool, [store.release_blocks])
    session = store.begin(("", "id"), "hello")
    assert session.adapter_for("a", named=True) == "a"  # not started: the call's choice
    blocks = allocator.allocate(8)
    store.keep(session, list(range(7)), " world", blocks.block_ids, adapter_id="a")
    allocator.free(blocks)
    store.end(session, succeeded=True)
    assert session.adapter_id == "a" and session.blocks
    assert session.adapter_for(None, named=False) == "a"
    assert session.adapter_for("a", named=True) == "a"
    for other in ("b", None):
        with pytest.raises(SessionAdapterConflict):
            session.adapter_for(other, named=True)
    store.release_adapter("a")  # unloaded: its blocks go, its tokens stay
    assert session.blocks == [] and session.token_ids == list(range(7))
    assert allocator.num_free_blocks == allocator.num_usable_blocks


# ---- metrics -----------------------------------------------------------------------------------

async def test_requests_are_counted_by_adapter_waiting_and_running(tmp_path):
    fake = FakeShardClient(step_delay=0.01)
    registry, infer, batcher, metrics = _stack(fake)
    await registry.load("a", str(make_adapter_dir(tmp_path)))
    # no loop yet: the requests wait in the queue
    waiting = [asyncio.create_task(infer.generate(_request("a"))) for _ in range(2)]
    base = asyncio.create_task(infer.generate(_request()))
    await wait_until_async(lambda: len(batcher.queue) == 3, "three queued")
    assert batcher.requests_by_adapter() == (Counter({"a": 2}), Counter())
    text = metrics.render().decode()
    assert 'tgi_adapter_queue_size{adapter="a"} 2.0' in text
    assert 'tgi_request_adapter_count{adapter="a"} 2.0' in text
    assert 'adapter=""' not in text, "the base model's requests carry no adapter label"
    loop = asyncio.create_task(batcher.run())
    try:
        await wait_until_async(lambda: batcher.requests_by_adapter()[1]["a"] == 2, "running")
        assert 'tgi_adapter_batch_current_size{adapter="a"} 2.0' in metrics.render().decode()
        await asyncio.gather(*waiting, base)
        assert infer.adapters.in_flight == Counter()
    finally:
        loop.cancel()


class _Shards:
    """A shard client whose adapter calls fail with the status codes a test sets."""

    def __init__(self):
        self.fail: dict[str, str] = {}

    async def load_adapter(self, name, path):
        if "load" in self.fail:
            raise ShardError(self.fail["load"], self.fail["load"])
        return convert.AdapterInfo(8, 16.0, 2.0, ("q_proj",), "")

    async def unload_adapter(self, name):
        if "unload" in self.fail:
            raise ShardError(self.fail["unload"], self.fail["unload"])


class _Batcher:
    healthy = True

    def requests_by_adapter(self):
        return Counter(), Counter()

    def forget_adapter(self, name):
        pass


def _registry(shards):
    from router.core.adapter_use import AdapterUse

    return AdapterStore(shards, AdapterUse(), _Batcher(),
                           Metrics(max_input_tokens=10, max_total_tokens=20), parent="m")


async def test_a_shard_that_keeps_a_name_and_cannot_free_it_is_an_adapter_error(tmp_path):
    """ALREADY_EXISTS (left by an unload that failed), then the freeing unload fails too: an
    AdapterError in the API's shape (424), never a bare shard error (a 500)."""
    shards = _Shards()
    registry = _registry(shards)
    shards.fail = {"load": "ALREADY_EXISTS", "unload": "FAILED_PRECONDITION"}
    with pytest.raises(AdapterError) as raised:
        await registry.load("a", str(make_adapter_dir(tmp_path)))
    assert raised.value.status == 424 and registry.names() == []


async def test_an_unload_waiting_while_a_restart_drops_the_adapter_ends_quietly(tmp_path):
    shards = _Shards()
    registry = _registry(shards)
    await registry.load("b", str(make_adapter_dir(tmp_path)))
    registry.use.in_flight["b"] += 1  # a request still running on it
    unload = asyncio.create_task(registry.unload("b"))
    await asyncio.sleep(0.05)
    shards.fail = {"load": "INVALID_ARGUMENT"}
    await registry.reload_all()  # the restarted group refuses it: dropped
    registry.use.in_flight["b"] -= 1
    await asyncio.wait_for(unload, 5)
    assert registry.names() == []


async def test_an_adapter_whose_shard_unload_failed_counts_until_it_is_freed(tmp_path, monkeypatch):
    """Its tensors may still be on the shards: it holds a --max-loras place. A load past the
    limit first tries to free it again, and takes the place once that succeeds."""
    from router.lifecycle import adapters

    monkeypatch.setattr(adapters, "BUSY_RETRY_S", 0)
    shards = _Shards()
    registry = _registry(shards)
    registry.max_loras = 1
    await registry.load("a", str(make_adapter_dir(tmp_path)))
    shards.fail = {"unload": "UNAVAILABLE"}
    with pytest.raises(AdapterError):
        await registry.unload("a")
    assert registry.names() == []
    with pytest.raises(AdapterError, match="--max-loras"):  # the shards still hold it
        await registry.load("b", str(make_adapter_dir(tmp_path)))
    shards.fail = {}
    await registry.load("b", str(make_adapter_dir(tmp_path)))
    assert registry.names() == ["b"]
