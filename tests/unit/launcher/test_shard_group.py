"""What a shard process is started with."""
from pathlib import Path

from launcher import shard_group
from launcher.shard_group import GroupSpec, ShardGroup, openmp_environment


def test_idle_openmp_threads_spin_shorter_unless_the_environment_says_otherwise():
    assert openmp_environment({}) == {"GOMP_SPINCOUNT": shard_group.OPENMP_SPIN_COUNT}
    assert openmp_environment({"GOMP_SPINCOUNT": "5"}) == {}
    assert openmp_environment({"OMP_WAIT_POLICY": "passive"}) == {}


def test_every_rank_gets_the_openmp_setting(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(shard_group, "spawn", lambda name, argv, env, json: started.append(env))
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spec = GroupSpec(name="m", model_dir=Path(tmp_path), num_shard=2, dtype="bfloat16",
                     device="cpu", uds_prefix=str(tmp_path / "s"), master_port=1)
    group = ShardGroup(spec, block_size=16, master_addr="127.0.0.1", tracing_argv=[],
                       json_output=False)
    group.spawn()
    assert [env["GOMP_SPINCOUNT"] for env in started] == [shard_group.OPENMP_SPIN_COUNT] * 2
    assert [env["RANK"] for env in started] == ["0", "1"]
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    started.clear()
    group.spawn()
    assert [env["GOMP_SPINCOUNT"] for env in started] == ["300000"] * 2
