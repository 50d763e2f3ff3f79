"""How much memory a shard's KV pool may take (shard/kv_budget.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shard import kv_budget

GIB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of 80 GiB with `state["free"]` bytes free and `state["ours"]` held by this process,
    as torch.cuda reports them."""
    state = {"free": 60 * GIB, "ours": 20 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["ours"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * GIB))
    return state


def test_on_cuda_the_pool_takes_90_percent_of_what_is_free(gpu):
    assert kv_budget.kv_budget_bytes(torch.device("cuda:0"), 1.0) == int(60 * GIB * 0.9)
    # each rank of a tensor-parallel group has a GPU of its own: no share between them
    assert kv_budget.kv_budget_bytes(torch.device("cuda:1"), 1.0, world_size=4) == int(60 * GIB * 0.9)


def test_on_cuda_a_memory_fraction_leaves_the_rest_of_the_gpu_to_others(gpu):
    # TGI's --cuda-memory-fraction 0.5: 40 of the 80 GiB for this process, 20 of them its weights
    assert kv_budget.kv_budget_bytes(torch.device("cuda:0"), 0.5) == int(20 * GIB * 0.9)
    gpu["free"] = 10 * GIB  # others took more than the share left to them: what is free
    assert kv_budget.kv_budget_bytes(torch.device("cuda:0"), 0.5) == int(10 * GIB * 0.9)
    gpu["ours"] = 41 * GIB  # this process holds more than its share already: no pool
    assert kv_budget.kv_budget_bytes(torch.device("cuda:0"), 0.5) == 0


def test_two_models_on_one_gpu_each_keep_to_their_share(gpu):
    # model A (10 GiB of weights) starts alone at 0.5, then B (10 GiB) beside it at 0.5
    gpu.update(free=70 * GIB, ours=10 * GIB)
    pool_a = kv_budget.kv_budget_bytes(torch.device("cuda:0"), 0.5)
    assert pool_a == int(30 * GIB * 0.9)
    gpu.update(free=70 * GIB - pool_a - 10 * GIB, ours=10 * GIB)
    pool_b = kv_budget.kv_budget_bytes(torch.device("cuda:0"), 0.5)
    assert pool_b == pool_a  # TGI's rule (free - 0.5 x total) gave B no pool at all
    assert 10 * GIB + pool_a + 10 * GIB + pool_b <= 80 * GIB


def test_on_the_cpu_ranks_share_30_percent_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_bytes", lambda device: 10 * GIB)
    cpu = torch.device("cpu")
    assert kv_budget.kv_budget_bytes(cpu, 1.0) == int(3 * GIB)
    assert kv_budget.kv_budget_bytes(cpu, 0.5, world_size=2) == int(0.75 * GIB)


def test_the_ledger_counts_live_shards_of_other_groups_only(tmp_path):
    import os
    import subprocess
    import sys

    from shard.kv_budget import PoolLedger

    mine = PoolLedger(tmp_path, "/tmp/s-g1")
    other = PoolLedger(tmp_path, "/tmp/s")
    assert mine.held_by_others() == 0  # nothing written down yet (and no directory is fine)
    other.record(3 * GIB)  # this process stands for a live shard of the default model's group
    assert mine.held_by_others() == 3 * GIB
    assert other.held_by_others() == 0, "a group's own ranks size together, not after"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / gone).write_text(f"{gone} /tmp/s-g2 {5 * GIB}")
    (tmp_path / "junk").write_text("not an entry")
    assert mine.held_by_others() == 3 * GIB  # a dead shard's pool went with it
    assert not (tmp_path / gone).exists()
    assert (tmp_path / str(os.getpid())).read_text() == f"{os.getpid()} /tmp/s {3 * GIB}"


def test_on_the_cpu_other_groups_pools_come_off_the_free_memory_first(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_bytes", lambda device: 10 * GIB)
    cpu = torch.device("cpu")
    assert kv_budget.kv_budget_bytes(cpu, 1.0, held_by_others=4 * GIB) == int(6 * GIB * 0.3)
    assert kv_budget.kv_budget_bytes(cpu, 1.0, held_by_others=12 * GIB) == 0


def test_an_engines_pool_is_written_down_and_sized_after_the_others(tmp_path, tiny_llama):
    from shard.kv_budget import PoolLedger
    from tests.engine_helpers import make_engine

    engine = make_engine(tiny_llama)
    engine.ledger = PoolLedger(tmp_path, "/tmp/first")
    engine.memory_fraction = 0.001  # a small pool: its size is what is written down
    result = engine.warmup([], 0)
    first = result.num_blocks * engine.runner.spec.bytes_per_block
    assert PoolLedger(tmp_path, "/tmp/second").held_by_others() == first
