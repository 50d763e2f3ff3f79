"""Launcher flags that span machines or pick weight forms: what is refused, and what is read from the
environment."""
import pytest

from launcher.config import LauncherConfig, parse_args


def test_a_schedulers_node_rank_in_the_environment_does_not_reach_a_single_machine(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("NNODES", "4")
    config = parse_args(["--model-id", "m"])
    assert (config.nnodes, config.node_rank) == (1, 0)


def test_machines_need_an_address_and_a_share_of_the_ranks():
    with pytest.raises(ValueError, match="needs --node-address"):
        LauncherConfig(num_shard=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="must be a multiple of --nnodes 2"):
        LauncherConfig(num_shard=3, nnodes=2, node_address="10.0.0.2")
    with pytest.raises(ValueError, match="must be within 0..--nnodes - 1"):
        LauncherConfig(num_shard=2, nnodes=2, node_rank=2, node_address="10.0.0.2")
    config = LauncherConfig(num_shard=4, nnodes=2, node_rank=1, node_address="10.0.0.2")
    assert config.local_ranks == range(2, 4)


def test_an_empty_quantize_means_none(monkeypatch):
    monkeypatch.setenv("QUANTIZE", "")
    assert parse_args(["--model-id", "m"]).quantize is None
    assert LauncherConfig(quantize="").quantize is None
