"""A default model's shards that die while the router warms them up are waited for and warmed up
again (router.lifecycle.served_model.build_served), where the router used to exit and end the launch."""
from types import SimpleNamespace

import pytest

from router.lifecycle import served_model
from router.shards.client import ShardError


class _Client:
    def __init__(self, alive: bool):
        self.alive, self.closed = alive, False

    async def is_same_group_alive(self):
        return self.alive

    async def close(self):
        self.closed = True


def _script(monkeypatch, outcomes):
    """Each connect gives the next client; each build fails (a ShardError, its group dead or not)
    or succeeds, in order. Returns the clients handed out."""
    handed = []

    async def connect(path, timeout=30.0):
        outcome = outcomes[len(handed)]
        if outcome == "not up":
            handed.append(None)
            raise ShardError("connect failed")
        handed.append(_Client(alive=outcome != "dies"))
        return handed[-1]

    async def build(config, client, adapter_links):
        if outcomes[len(handed) - 1] in ("dies", "refuses"):
            raise ShardError("Stream removed (Socket closed)")
        return "served"

    monkeypatch.setattr(served_model.ShardedClient, "connect", staticmethod(connect))
    monkeypatch.setattr(served_model, "_build", build)
    monkeypatch.setattr(served_model.asyncio, "sleep", _no_sleep)
    return handed


async def _no_sleep(seconds):
    return None


CONFIG = SimpleNamespace(master_shard_uds_path="/tmp/none-0", shard_recovery_timeout=60.0)


async def test_a_group_that_dies_while_warming_up_is_waited_for(monkeypatch):
    handed = _script(monkeypatch, ["dies", "not up", "not up", "ok"])
    assert await served_model.build_served(CONFIG, through_restarts=True) == "served"
    assert handed[0].closed and len(handed) == 4


async def test_without_waiting_or_when_the_same_group_refused_the_error_stands(monkeypatch):
    _script(monkeypatch, ["dies", "ok"])
    with pytest.raises(ShardError, match="exited while they were warmed up"):  # a second
        await served_model.build_served(CONFIG)  # model's start: its caller reports the death
    handed = _script(monkeypatch, ["refuses", "ok"])
    with pytest.raises(ShardError):  # the group is alive: warming it up again would fail again
        await served_model.build_served(CONFIG, through_restarts=True)
    assert len(handed) == 1 and handed[0].closed


async def test_a_group_not_back_within_the_wait_is_the_error(monkeypatch):
    _script(monkeypatch, ["dies"] + ["not up"] * 1000)
    clock = iter(range(0, 10**6, 10))  # 10 s a call: past GROUP_START_WAIT after about 60 tries
    monkeypatch.setattr(served_model, "_now", lambda: next(clock))
    with pytest.raises(ShardError, match="connect failed"):
        await served_model.build_served(CONFIG, through_restarts=True)


async def test_a_long_first_warm_up_is_not_cut_short(monkeypatch):
    """The wait starts when the group is found gone, not when the first warm-up began."""
    handed = _script(monkeypatch, ["dies", "not up", "ok"])
    ticks = iter([10_000.0] + [10_001.0] * 10)  # the first warm-up took hours
    monkeypatch.setattr(served_model, "_now", lambda: next(ticks))
    assert await served_model.build_served(CONFIG, through_restarts=True) == "served"
    assert len(handed) == 3
