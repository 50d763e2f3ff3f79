"""Which GPUs each shard group's ranks see (launcher/gpus.py and the supervisor's use of it)."""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from launcher import gpus, shard_group, supervisor
from launcher.config import parse_args
from launcher.gpus import pick_gpus, visible_gpus
from launcher.shard_group import LaunchError
from launcher.supervisor import Supervisor


def test_visible_gpus_follow_cuda_visible_devices_else_nvidia_smi(monkeypatch):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5f1c,GPU-77ab"}) == ["GPU-5f1c", "GPU-77ab"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,0"}) == ["1"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aa)\n"
               "  MIG 3g.40gb     Device  0: (UUID: MIG-bb)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-cc)\n")
    monkeypatch.setattr(gpus.subprocess, "run",
                        lambda *a, **k: SimpleNamespace(returncode=0, stdout=listing))
    assert visible_gpus({}) == ["0", "1"]
    monkeypatch.setattr(gpus.subprocess, "run",
                        lambda *a, **k: SimpleNamespace(returncode=9, stdout="no driver"))
    assert visible_gpus({}) == []

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(gpus.subprocess, "run", missing)
    assert visible_gpus({}) == []

    def hung(*args, **kwargs):
        raise subprocess.TimeoutExpired("nvidia-smi", 20)

    monkeypatch.setattr(gpus.subprocess, "run", hung)
    assert visible_gpus({}) == []


def test_a_group_gets_distinct_gpus_the_others_use_least():
    four = ["0", "1", "2", "3"]
    assert pick_gpus(four, [], 2) == ("0", "1")
    assert pick_gpus(four, ["0", "1"], 1) == ("2",)
    assert pick_gpus(four, ["0", "1", "2"], 2) == ("0", "3")  # a tie goes to the first listed
    assert pick_gpus(["3", "1"], ["3"], 1) == ("1",)
    assert pick_gpus(["3", "1"], [], 2) == ("3", "1")  # CUDA_VISIBLE_DEVICES's order kept
    with pytest.raises(ValueError, match="3 shard\\(s\\) on CUDA need as many GPUs: 2 visible"):
        pick_gpus(["0", "1"], [], 3)


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """A supervisor on a machine with four GPUs whose children are recorded, not started."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "num_attention_heads": 10,
                                                      "num_key_value_heads": 10}))
    started = []
    monkeypatch.setattr(shard_group, "spawn", lambda name, argv, env, json: started.append(env))
    monkeypatch.setattr(Supervisor, "_wait_until", lambda *args, **kwargs: None)
    monkeypatch.setattr(shard_group.ShardGroup, "stop", lambda *args: None)
    monkeypatch.setattr(supervisor, "visible_gpus", lambda environ: ["0", "1", "2", "3"])
    config = parse_args(["--model-id", "m", "--num-shard", "2", "--shard-uds-path",
                         str(tmp_path / "s")])
    launched = Supervisor(config, tmp_path, "m")
    launched.started = started
    return launched


def _seen(launched, name, num_shard, device, tmp_path) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES each rank of a newly started group got."""
    launched.started.clear()
    launched.start_group(name, tmp_path, num_shard=num_shard, dtype=None, device=device)
    return [env.get("CUDA_VISIBLE_DEVICES") for env in launched.started]


def test_models_started_beside_the_default_one_spread_over_the_gpus(launched, tmp_path,
                                                                   monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    default = launched._group("m", tmp_path, 2, None, "auto", uds_prefix=str(tmp_path / "d"),
                              master_port=1, label="", ranks_here=2)
    launched.groups["m"] = default
    default.spawn()
    assert [env["CUDA_VISIBLE_DEVICES"] for env in launched.started] == ["0,1", "0,1"]
    assert [env["LOCAL_RANK"] for env in launched.started] == ["0", "1"]  # cuda:0 and cuda:1
    # every group's shards write their CPU KV pools down in the launcher's ledger
    assert {env["TGI_PY_KV_LEDGER"] for env in launched.started} == {launched.kv_ledger}
    assert launched.kv_ledger == str(tmp_path / "s") + "-kv-ledger"
    assert _seen(launched, "a", 1, "auto", tmp_path) == ["2"]
    assert _seen(launched, "b", 2, "cuda", tmp_path) == ["0,3", "0,3"]
    assert _seen(launched, "on-cpu", 1, "cpu", tmp_path) == [None]  # ngl 0: no GPU taken
    launched.stop_group("a")  # its GPU is free again
    assert _seen(launched, "c", 1, "cuda", tmp_path) == ["2"]
    with pytest.raises(LaunchError, match="too-big: 5 shard\\(s\\) on CUDA need as many GPUs"):
        launched.start_group("too-big", tmp_path, num_shard=5, dtype=None, device="cuda")
    assert "too-big" not in launched.groups
    # device auto with too few GPUs: every rank on the CPU (rank 4 would ask for cuda:4)
    assert _seen(launched, "auto-cpu", 5, "auto", tmp_path) == [None] * 5
    assert launched.groups["auto-cpu"].spec.device == "cpu"
    assert launched.groups["m"].spec.device == "auto"

