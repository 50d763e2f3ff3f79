"""How much memory a shard's KV pool may take (shard/memory.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shard import memory

GIB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of 80 GiB with `state["free"]` bytes free, as torch.cuda reports it."""
    state = {"free": 60 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * GIB))
    return state


def test_on_cuda_the_pool_takes_90_percent_of_what_is_free(gpu):
    assert memory.kv_budget_bytes(torch.device("cuda:0"), 1.0) == int(60 * GIB * 0.9)
    # each rank of a tensor-parallel group has a GPU of its own: no share between them
    assert memory.kv_budget_bytes(torch.device("cuda:1"), 1.0, world_size=4) == int(60 * GIB * 0.9)


def test_on_cuda_a_memory_fraction_leaves_the_rest_of_the_gpu_to_others(gpu):
    # TGI's --cuda-memory-fraction 0.5: 40 of the 80 GiB stay free for another process
    assert memory.kv_budget_bytes(torch.device("cuda:0"), 0.5) == int(20 * GIB * 0.9)
    gpu["free"] = 30 * GIB  # others took more than the share left to them: no pool at all
    assert memory.kv_budget_bytes(torch.device("cuda:0"), 0.5) == 0


def test_on_the_cpu_ranks_share_30_percent_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * GIB)
    cpu = torch.device("cpu")
    assert memory.kv_budget_bytes(cpu, 1.0) == int(3 * GIB)
    assert memory.kv_budget_bytes(cpu, 0.5, world_size=2) == int(0.75 * GIB)
