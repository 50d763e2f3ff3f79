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


def test_cuda_graphs_take_tgis_flag_and_environment_variable(monkeypatch):
    # unset: up to the largest decode batch, chosen by each shard at warm-up
    assert parse_args(["--model-id", "m"]).cuda_graphs == "auto"
    monkeypatch.setenv("CUDA_GRAPHS", "0")
    assert parse_args(["--model-id", "m"]).cuda_graphs == "0"
    with pytest.raises(ValueError, match="--cuda-graphs"):
        LauncherConfig(cuda_graphs="1,two")


def test_cuda_memory_fraction_takes_tgis_flag_and_environment_variable_and_reaches_the_shards(
        monkeypatch, tmp_path):
    from launcher import shard_group
    from launcher.supervisor import Supervisor

    monkeypatch.delenv("CUDA_MEMORY_FRACTION", raising=False)
    assert parse_args(["--model-id", "m"]).cuda_memory_fraction == 1.0
    monkeypatch.setenv("CUDA_MEMORY_FRACTION", "0.45")  # TGI's variable
    config = parse_args(["--model-id", "m"])
    assert config.cuda_memory_fraction == 0.45
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(ValueError, match="--cuda-memory-fraction"):
            parse_args(["--model-id", "m", "--cuda-memory-fraction", bad])
    started = []
    monkeypatch.setattr(shard_group, "spawn", lambda name, argv, env, json: started.append(argv))
    Supervisor(config, tmp_path, "m")._group("m", tmp_path, 1, None, "cpu",
                                             uds_prefix=str(tmp_path / "s"), master_port=1,
                                             label="").spawn()
    argv = started[0]
    assert argv[argv.index("--memory-fraction") + 1] == "0.45"
    from shard.config import parse_args as shard_args
    assert shard_args(["--model-path", "m", "--memory-fraction", "0.45"]).memory_fraction == 0.45
    with pytest.raises(ValueError, match="--memory-fraction"):
        shard_args(["--model-path", "m", "--memory-fraction", "0"])


def test_without_dtype_the_shards_and_the_routers_models_take_the_devices_default(monkeypatch,
                                                                                 tmp_path):
    from launcher import shard_group, supervisor
    from launcher.supervisor import Supervisor

    monkeypatch.delenv("DTYPE", raising=False)
    assert parse_args(["--model-id", "m"]).dtype is None
    monkeypatch.setenv("DTYPE", "")
    assert parse_args(["--model-id", "m"]).dtype is None
    with pytest.raises(ValueError, match="is not one of"):
        LauncherConfig(dtype="int8")
    started = []
    monkeypatch.setattr(shard_group, "spawn", lambda name, argv, env, json: started.append(argv))
    monkeypatch.setattr(supervisor, "spawn", lambda name, argv, env, json: started.append(argv))
    monkeypatch.setattr(Supervisor, "_wait_until", lambda *args, **kwargs: None)

    def dtypes(config):
        """(the shard's --dtype, the router's --default-model-dtype)"""
        started.clear()
        launched = Supervisor(config, tmp_path, "m")
        launched._group("m", tmp_path, 1, config.dtype, "cpu", uds_prefix=str(tmp_path / "s"),
                        master_port=1, label="").spawn()
        launched._start_router()
        shard, router = started
        return shard[shard.index("--dtype") + 1], router[router.index("--default-model-dtype") + 1]

    assert dtypes(parse_args(["--model-id", "m"])) == ("", "")  # "": the shard decides
    assert dtypes(parse_args(["--model-id", "m", "--dtype", "float32"])) == ("float32", "float32")
    monkeypatch.setenv("DTYPE", "float32")  # TGI's variable
    assert dtypes(parse_args(["--model-id", "m"])) == ("float32", "float32")


def test_every_commands_help_renders():
    """argparse formats help texts with %: a bare one ("30%") broke --help."""
    from launcher.config import build_parser
    from router.config import parse_args as router_args
    from shard.config import parse_args as shard_args

    assert "--cuda-memory-fraction" in build_parser().format_help()
    for parse in (router_args, shard_args):
        with pytest.raises(SystemExit) as done:
            parse(["--help"])
        assert done.value.code == 0


def test_the_router_drains_for_most_of_the_grace_and_keeps_time_to_answer(monkeypatch, tmp_path):
    from launcher import supervisor
    from launcher.router_flags import router_drain_timeout
    from launcher.supervisor import Supervisor
    from router.config import parse_args as router_args

    assert [router_drain_timeout(g) for g in (20, 90, 6, 3, 0)] == [15, 85, 3, 1.5, 0]
    started = []
    monkeypatch.setattr(supervisor, "spawn", lambda name, argv, env, json: started.append(argv))
    monkeypatch.setattr(Supervisor, "_wait_until", lambda *args, **kwargs: None)
    Supervisor(parse_args(["--model-id", "m", "-g", "3"]), tmp_path, "m")._start_router()
    (argv,) = started
    assert router_args(argv[3:]).server.drain_timeout == 1.5
    with pytest.raises(ValueError, match="--drain-timeout -1.0 must be 0 or more"):
        router_args(["--tokenizer-path", "m", "--drain-timeout", "-1"])
