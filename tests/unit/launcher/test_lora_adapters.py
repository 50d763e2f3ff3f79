"""--lora-adapters from the flag to the router: TGI's entry forms parsed, each resolved to a local
PEFT directory before any shard starts (a Hub id through the fake Hub), the router's argument; and
ModelHost's Pull of an adapter, its two files as they are."""
import faulthandler
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from launcher.adapters import (AdapterSpec, parse_lora_adapters, resolve_adapter,
                               resolve_adapters, router_adapters_argv)
from launcher.config import parse_args
from launcher.known_models import DEFAULT_MODEL
from launcher.model_cache import ModelResolutionError
from tests.lora_adapters import build_adapter
from tests.unit.launcher.fake_hub import FakeHub

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def peft_adapter(tiny_llama, tmp_path_factory) -> Path:
    """A LoRA adapter of the tiny Llama saved by peft (with its README beside the two files)."""
    out = build_adapter(tiny_llama, tmp_path_factory.mktemp("adapter"), rank=2,
                        targets=["q_proj", "v_proj"])
    assert set(ADAPTER_FILES) < {p.name for p in out.iterdir()}
    return out


@pytest.fixture(autouse=True)
def _no_adapters_in_the_environment(monkeypatch):
    monkeypatch.delenv("LORA_ADAPTERS", raising=False)
    monkeypatch.delenv("MODEL_ID", raising=False)


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# parsing

def test_every_entry_form_and_its_name():
    specs = parse_lora_adapters(" org/a , org/b@v2,mine=/data/x@y=z,./local", model_id="m")
    assert specs == [AdapterSpec("org/a", "org/a"),
                     AdapterSpec("org/b", "org/b", "v2"),
                     # a name holds no '=': the path is everything after the first one
                     AdapterSpec("mine", "/data/x@y=z", is_local=True),
                     AdapterSpec("./local", "./local")]
    assert parse_lora_adapters(None, model_id="m") == parse_lora_adapters(" ", model_id="m") == []


def test_the_flag_and_its_environment_variable_give_the_same_adapters(monkeypatch):
    flag = parse_args(["--lora-adapters", "org/a,n=/p"])
    monkeypatch.setenv("LORA_ADAPTERS", "org/a,n=/p")
    from_environment = parse_args([])
    assert from_environment == flag
    assert [s.name for s in from_environment.adapter_specs()] == ["org/a", "n"]


@pytest.mark.parametrize("value, words", [
    ("org/a,,org/b", "empty entry"),
    ("org/a,", "empty entry"),
    ("=/data/x", "empty name"),
    ("n=", "empty path"),
    ("org/a@", "id@revision"),
    ("@v2", "id@revision"),
    ("org/a,org/a@v2", "twice"),
    ("n=/x,n=/y", "twice"),
    ("my adapter=/x", "space"),
    ("tgi=/x", "not 'tgi'"),  # the router's rule, before any shard starts
    ('a"b=/x', "without quotes"),
    ("m", "the model's own"),
    ("m=/data/x", "the model's own"),
])
def test_a_malformed_entry_is_refused_at_start_naming_the_flag(value, words):
    with pytest.raises(ValueError, match=words) as err:
        parse_args(["--model-id", "m", "--lora-adapters", value])
    assert str(err.value).startswith("--lora-adapters")


def test_without_model_id_the_default_models_name_is_taken():
    with pytest.raises(ValueError, match="the model's own"):
        parse_args(["--lora-adapters", DEFAULT_MODEL.name])


# resolution to local directories

def test_a_local_directory_is_itself_made_absolute_in_either_form(peft_adapter, monkeypatch):
    monkeypatch.chdir(peft_adapter.parent)
    relative = f"./{peft_adapter.name}"
    dirs = resolve_adapters(parse_lora_adapters(f"{peft_adapter},mine={relative}", model_id="m"))
    assert dirs == {str(peft_adapter): peft_adapter, "mine": peft_adapter}
    assert all(d.is_absolute() for d in dirs.values())


def test_adapter_model_bin_is_taken_without_safetensors(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"weights")
    assert resolve_adapter(AdapterSpec("a", str(tmp_path))) == tmp_path


@pytest.mark.parametrize("present, words", [
    ([], "holds no adapter_config.json: not a PEFT LoRA adapter"),
    (["adapter_config.json"], "holds neither adapter_model.safetensors nor adapter_model.bin"),
    (["adapter_model.safetensors"], "holds no adapter_config.json"),
])
def test_a_directory_missing_a_file_names_it(tmp_path, present, words):
    for name in present:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelResolutionError, match=words):
        resolve_adapter(AdapterSpec("a", str(tmp_path)))


def test_a_missing_path_is_not_looked_up_on_the_hub(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path, tmp_path)
    for text in ("n=no/such/dir", f"{tmp_path}/nothing"):
        (spec,) = parse_lora_adapters(text, model_id="m")
        with pytest.raises(ModelResolutionError, match="does not exist"):
            resolve_adapter(spec)
    assert hub.calls == []


def test_a_revision_of_a_local_directory_is_refused(peft_adapter):
    (spec,) = parse_lora_adapters(f"{peft_adapter}@v2", model_id="m")
    with pytest.raises(ModelResolutionError, match="Hub revision"):
        resolve_adapter(spec)


def test_a_path_with_a_comma_cannot_reach_the_router(peft_adapter, tmp_path):
    odd = shutil.copytree(peft_adapter, tmp_path / "a,b")
    with pytest.raises(ModelResolutionError, match="holds a ','"):
        resolve_adapters([AdapterSpec("n", str(odd), is_local=True)])


# Hub ids, through the fake Hub

def _adapter_repo(peft_adapter: Path, out: Path, *, weights: str = "adapter_model.safetensors",
                  extra: tuple[str, ...] = ()) -> Path:
    out.mkdir()
    (out / "adapter_config.json").write_bytes((peft_adapter / "adapter_config.json").read_bytes())
    (out / weights).write_bytes((peft_adapter / "adapter_model.safetensors").read_bytes())
    for name in extra:
        (out / name).write_text("not fetched")
    return out


def test_a_hub_id_downloads_the_config_and_safetensors_alone(monkeypatch, peft_adapter, tmp_path):
    repo = _adapter_repo(peft_adapter, tmp_path / "repo",
                         extra=("adapter_model.bin", "README.md", "training_args.bin"))
    hub = FakeHub(monkeypatch, repo, tmp_path)
    (spec,) = parse_lora_adapters("org/adapter@v2", model_id="m")
    assert resolve_adapters([spec], hub_cache=str(tmp_path / "hub")) == {"org/adapter": repo}
    fetched = hub.called("hf_hub_download")
    assert [(repo_id, name) for repo_id, name, _ in fetched] == [
        ("org/adapter", "adapter_config.json"), ("org/adapter", "adapter_model.safetensors")]
    assert all(kw == {"revision": "v2", "cache_dir": str(tmp_path / "hub")}
               for _, _, kw in fetched)


def test_a_hub_adapter_without_safetensors_gets_its_bin(monkeypatch, peft_adapter, tmp_path):
    repo = _adapter_repo(peft_adapter, tmp_path / "repo", weights="adapter_model.bin")
    hub = FakeHub(monkeypatch, repo, tmp_path)
    assert resolve_adapter(AdapterSpec("org/a", "org/a")) == repo
    assert [name for _, name, _ in hub.called("hf_hub_download")] == [
        "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def test_a_hub_repository_that_is_no_adapter_says_so(monkeypatch, tiny_llama, tmp_path):
    FakeHub(monkeypatch, tiny_llama, tmp_path)
    with pytest.raises(ModelResolutionError, match="'org/model' holds no adapter_config.json"):
        resolve_adapter(AdapterSpec("org/model", "org/model"))


def test_a_hub_adapter_without_weights_says_so(monkeypatch, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "adapter_config.json").write_text("{}")
    FakeHub(monkeypatch, tmp_path / "repo", tmp_path)
    with pytest.raises(ModelResolutionError, match="is in the repository"):
        resolve_adapter(AdapterSpec("org/a", "org/a"))


def test_offline_and_not_cached_is_one_clear_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and "
                                      "outgoing traffic has been disabled.\nmore")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ModelResolutionError) as err:
        resolve_adapter(AdapterSpec("org/a", "org/a"))
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE=1" in message
    assert "LocalEntryNotFoundError: Cannot find the requested files" in message


# the launcher's start, and the router's argument

def test_the_router_gets_name_equals_absolute_directory_pairs(monkeypatch, peft_adapter,
                                                              tmp_path):
    from launcher import supervisor as supervising
    from router.config import parse_args as router_args

    started = []
    monkeypatch.setattr(supervising, "spawn", lambda name, argv, env, json: started.append(argv))
    dirs = {"org/a": peft_adapter, "mine": Path("/data/x=y")}
    supervisor = supervising.Supervisor(parse_args([]), tmp_path, "m", adapter_dirs=dirs)
    monkeypatch.setattr(supervisor, "_wait_until", lambda *args, **kwargs: None)
    supervisor._start_router()
    (argv,) = started
    value = argv[argv.index("--lora-adapters") + 1]
    assert value == f"org/a={peft_adapter},mine=/data/x=y"
    # the rule the router reads it by: ',' between entries, the first '=' in each
    assert dict(entry.split("=", 1) for entry in value.split(",")) == {
        "org/a": str(peft_adapter), "mine": "/data/x=y"}
    assert argv.count("--lora-adapters") == 1
    router = router_args(argv[argv.index("-m") + 2:])  # as the router reads its flags
    assert router.server.lora_adapter_dirs() == [("org/a", str(peft_adapter)), ("mine", "/data/x=y")]
    assert router_adapters_argv({}) == []


@pytest.fixture
def launch(monkeypatch, tmp_path, tiny_llama):
    """launcher.__main__.main up to the Supervisor, which records what it got instead of
    starting any process."""
    from launcher import __main__ as entry

    got = {}

    def supervisor(config, model_dir, model_name, **kwargs):
        got.update(kwargs, model_name=model_name)
        return SimpleNamespace(run=lambda: 0)

    monkeypatch.setattr(entry, "Supervisor", supervisor)
    monkeypatch.chdir(tmp_path)  # no .env of the repository's

    def run(adapters: str) -> tuple[int, dict]:
        got.clear()
        try:
            return entry.main(["--model-id", str(tiny_llama), "--lora-adapters", adapters]), got
        finally:
            faulthandler.unregister(signal.SIGUSR1)  # main's, writing to this test's stderr
    return run


def test_the_launcher_hands_the_resolved_directories_to_the_supervisor(launch, peft_adapter):
    code, got = launch(f"mine={peft_adapter}")
    assert code == 0 and got["adapter_dirs"] == {"mine": peft_adapter}


def test_an_adapter_that_cannot_be_resolved_ends_the_start_before_any_shard(launch, tmp_path,
                                                                            capfd):
    code, got = launch(f"mine={tmp_path}")  # a directory, but no adapter
    assert code == 1 and got == {}, "no Supervisor: no shard started"
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert line.startswith("tgi-launcher: ") and "holds no adapter_config.json" in line


# ModelHost's Pull of an adapter

@pytest.fixture
def model_host():
    """A stub to the launcher's ModelHost service on a Unix socket (a short path: sockets are
    limited to about 100 bytes)."""
    from launcher.model_host import serve
    from proto import model_host_pb2_grpc as pb_grpc

    socket_dir = tempfile.mkdtemp(prefix="mh-")
    socket_path = os.path.join(socket_dir, "s")
    server = serve(SimpleNamespace(config=parse_args([])), socket_path)
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    try:
        yield pb_grpc.ModelHostStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        shutil.rmtree(socket_dir, ignore_errors=True)


def _pull(stub, **fields) -> list:
    from proto import model_host_pb2 as pb

    return list(stub.Pull(pb.PullRequest(adapter=True, **fields), timeout=30))


def test_pull_copies_a_local_adapters_two_files_as_they_are(model_host, peft_adapter, tmp_path):
    target = tmp_path / "registry" / "adapters" / "mine"
    messages = _pull(model_host, source=str(peft_adapter), target_dir=str(target))
    assert _names(target) == ADAPTER_FILES  # the README stays behind
    for name in ADAPTER_FILES:
        assert (target / name).read_bytes() == (peft_adapter / name).read_bytes()
    size = sum((peft_adapter / name).stat().st_size for name in ADAPTER_FILES)
    *progress, last = messages
    assert [(m.stage, m.bytes_done, m.bytes_total) for m in progress][-1] == ("copying", size, size)
    assert (last.done, last.format, last.size_bytes) == (True, "peft", size)
    assert json.loads((target / "adapter_config.json").read_text())["r"] == 2


def test_pull_of_a_directory_without_adapter_config_fails_its_precondition(model_host, tiny_llama,
                                                                           tmp_path):
    target = tmp_path / "registry" / "m"
    with pytest.raises(grpc.RpcError) as err:
        _pull(model_host, source=str(tiny_llama), target_dir=str(target))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds no adapter_config.json: not a PEFT LoRA adapter" in err.value.details()
    assert _names(tmp_path / "registry") == []  # no staging directory left behind


def test_pull_of_a_hub_adapter_downloads_then_copies(model_host, monkeypatch, peft_adapter,
                                                      tmp_path):
    repo = _adapter_repo(peft_adapter, tmp_path / "repo", extra=("README.md",))
    hub = FakeHub(monkeypatch, repo, tmp_path)
    target = tmp_path / "registry" / "org-a"
    messages = _pull(model_host, source="org/a", target_dir=str(target), revision="v2")
    assert _names(target) == ADAPTER_FILES
    assert {kw["revision"] for _, _, kw in hub.called("hf_hub_download")} == {"v2"}
    stages = list(dict.fromkeys(m.stage for m in messages if not m.done))
    assert stages == ["downloading", "copying"] and messages[-1].format == "peft"


def test_a_hub_adapter_over_the_models_bound_is_refused_before_any_download(
        model_host, monkeypatch, peft_adapter, tmp_path):
    repo = _adapter_repo(peft_adapter, tmp_path / "repo", extra=("README.md",))
    hub = FakeHub(monkeypatch, repo, tmp_path)
    size = sum((repo / name).stat().st_size for name in ADAPTER_FILES)
    with pytest.raises(grpc.RpcError) as err:
        _pull(model_host, source="org/a", target_dir=str(tmp_path / "big"), revision="v2",
              max_bytes=size - 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"its files hold {size} bytes, more than any LoRA adapter" in err.value.details()
    assert hub.called("hf_hub_download") == [], "nothing downloaded"
    assert [kw["revision"] for _, kw in hub.called("list_repo_tree")] == ["v2"]
    _pull(model_host, source="org/a", target_dir=str(tmp_path / "fits"), max_bytes=size)
    assert _names(tmp_path / "fits") == ADAPTER_FILES


def test_a_local_adapter_over_the_bound_is_refused_before_it_is_copied(model_host, peft_adapter,
                                                                       tmp_path):
    with pytest.raises(grpc.RpcError, match="more than any LoRA adapter this model takes"):
        _pull(model_host, source=str(peft_adapter), target_dir=str(tmp_path / "t"), max_bytes=10)
    assert not (tmp_path / "t").exists()
