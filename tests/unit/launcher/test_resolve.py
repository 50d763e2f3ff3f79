"""Model id resolution: local directories, .gguf files, the default model and Hub ids."""
import json
import os
from pathlib import Path

import pytest

from launcher import gguf as conversion
from launcher import prepare
from launcher.config import parse_args
from launcher.known_models import GEMMA3_270M, SMOLLM2
from launcher.resolve import DEFAULT_MODEL_ID, ModelResolutionError, resolve_model
from shard.checkpoint_files import INDEX_NAME
from tests.unit.launcher.fake_hub import SHARDS, FakeHub, write_sharded
from tests.unit.launcher.tiny_gguf import write_tiny_gguf


def test_local_directory_is_used_as_it_is(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama


def test_incomplete_directory_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ModelResolutionError, match=r"lacks \*\.safetensors, tokenizer\.json"):
        resolve_model(str(tmp_path))


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelResolutionError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ModelResolutionError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_offline_unknown_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelResolutionError,
                       match=r"'someone/not-a-cached-model' is neither a local model directory, "
                             r"a \.gguf file, a known model \(smollm2-135m-instruct, "
                             r"gemma3-270m, all-minilm-l6-v2\), nor a model the Hugging Face "
                             r"Hub could provide"):
        resolve_model("someone/not-a-cached-model", cache_dir=tmp_path, hub_cache=str(tmp_path))


MODEL_FILES = ["*.json", "*.jinja", "tokenizer*"]


def test_an_explicit_hub_id_is_that_repositorys_checkpoint_at_its_revision(monkeypatch, tiny_llama,
                                                                            tmp_path):
    """Even the default model's Hub id: only no --model-id (or the short name) is the GGUF; and
    of a repository with HF shards and a consolidated.safetensors, only the shards."""
    hub = FakeHub(monkeypatch, write_sharded(tiny_llama, tmp_path / "repo"), tmp_path)
    monkeypatch.setattr(prepare, "prepare_known_model",
                        lambda *a, **kw: pytest.fail("the packaged GGUF was used"))
    got = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", revision="v1", cache_dir=tmp_path,
                        hub_cache=str(tmp_path / "hub"))
    assert hub.called("hf_hub_download") == [("HuggingFaceTB/SmolLM2-135M-Instruct", INDEX_NAME, {
        "revision": "v1", "cache_dir": str(tmp_path / "hub")})]
    ((repo_id, kwargs),) = hub.called("snapshot_download")
    assert repo_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert kwargs["revision"] == "v1" and kwargs["cache_dir"] == str(tmp_path / "hub")
    assert hub.allowed() == MODEL_FILES + [INDEX_NAME, *SHARDS]
    assert not (got / "consolidated.safetensors").exists()
    assert sorted(p.name for p in got.glob("*.safetensors")) == list(SHARDS)


@pytest.mark.parametrize("weights, expected", [
    (["model.safetensors", "consolidated.safetensors"], ["model.safetensors"]),
    # the last resort: the top-level files the repository lists
    (["b.safetensors", "a.safetensors", "sub/c.safetensors"], ["a.safetensors", "b.safetensors"]),
])
def test_without_an_index_the_single_file(monkeypatch, tmp_path, weights, expected):
    repo = tmp_path / "repo"
    for name in ["config.json", "tokenizer.json", *weights]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("{}")
    hub = FakeHub(monkeypatch, repo, tmp_path)
    got = resolve_model("org/model", revision="main", cache_dir=tmp_path)
    assert hub.called("list_repo_files") == [("org/model", {"revision": "main"})]
    assert hub.allowed() == MODEL_FILES + expected
    assert sorted(p.name for p in got.rglob("*.safetensors")) == expected


def test_offline_without_a_cached_index_takes_the_cached_snapshot(monkeypatch, tiny_llama,
                                                                  tmp_path):
    """What the cache holds is all there is; the shard's loader picks the checkpoint from it."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    hub = FakeHub(monkeypatch, tiny_llama, tmp_path)

    def offline(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    resolve_model("org/model", cache_dir=tmp_path)
    assert hub.allowed() == MODEL_FILES + ["*.safetensors"]


def test_a_snapshot_missing_a_shard_of_its_index_names_it(monkeypatch, tiny_llama, tmp_path):
    repo = write_sharded(tiny_llama, tmp_path / "repo", consolidated=False)
    (repo / SHARDS[1]).unlink()
    FakeHub(monkeypatch, repo, tmp_path)
    with pytest.raises(ModelResolutionError,
                       match=rf"Hub model 'org/m'.*lacks {SHARDS[1]}, named by {INDEX_NAME}"):
        resolve_model("org/m", cache_dir=tmp_path)


def test_hub_snapshot_without_safetensors_names_the_id(monkeypatch, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("config.json", "tokenizer.json", "pytorch_model.bin"):
        (repo / name).write_text("{}")
    FakeHub(monkeypatch, repo, tmp_path)
    with pytest.raises(ModelResolutionError,
                       match=r"Hub model 'org/bin-only'.*lacks \*\.safetensors"):
        resolve_model("org/bin-only", cache_dir=tmp_path)


@pytest.mark.parametrize("model_id, model", [(None, SMOLLM2), (DEFAULT_MODEL_ID, SMOLLM2),
                                            ("gemma3-270m", GEMMA3_270M),
                                            ("Gemma3-270M", GEMMA3_270M)])
def test_short_names_are_prepared_in_the_cache(monkeypatch, tiny_llama, tmp_path, model_id, model):
    prepared = []
    monkeypatch.setattr(prepare, "prepare_known_model",
                        lambda known, cache_dir, dtype: prepared.append((known, cache_dir, dtype))
                        or tiny_llama)
    assert resolve_model(model_id, cache_dir=tmp_path, convert_dtype="float32") == tiny_llama
    assert prepared == [(model, tmp_path, "float32")]


def test_a_revision_of_a_short_name_is_refused(tmp_path):
    with pytest.raises(ModelResolutionError, match=r"--revision v2 names a Hub revision, but "
                                                   r"gemma3-270m comes from PyPI"):
        resolve_model("gemma3-270m", revision="v2", cache_dir=tmp_path)


def test_a_local_directory_named_like_a_short_name_is_that_directory(monkeypatch, tiny_llama,
                                                                     tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").symlink_to(tiny_llama)
    monkeypatch.setattr(prepare, "prepare_known_model", lambda *a, **kw: pytest.fail("fetched"))
    assert resolve_model("gemma3-270m") == Path("gemma3-270m")


def test_gguf_file_is_converted_once_per_version_of_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr(conversion, "write_tokenizer",
                        lambda gguf_path, out_dir, **kw: (out_dir / "tokenizer.json").write_text("{}"))
    gguf_path = write_tiny_gguf(tmp_path / "src" / "tiny.gguf").path
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert first.name.endswith("-bf16") and any(first.glob("*.safetensors"))

    converted = []
    monkeypatch.setattr(prepare, "convert_gguf", lambda *a, **kw: converted.append(a) or a[1])
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache") == first
    assert converted == []
    # float32 (--dtype float32, --quantize) is another conversion, beside the bf16 one
    with pytest.raises(ModelResolutionError):  # the fake converter wrote nothing
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", convert_dtype="float32")
    assert converted[-1][1] == first.with_name(first.name.replace("-bf16", "-f32"))
    converted.clear()
    os.utime(gguf_path, ns=(0, 0))  # an edited file is a different model
    with pytest.raises(ModelResolutionError):  # the fake converter wrote nothing
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert converted and converted[0][1] != first


def test_flags_and_environment_variables(monkeypatch):
    monkeypatch.setenv("MODEL_ID", "/models/x")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "2048")
    config = parse_args(["--num-shard", "2", "--max-input-tokens", "1000", "--port", "9000"])
    assert config.model_id == "/models/x" and config.num_shard == 2 and config.port == 9000
    argv = config.router_argv(tokenizer_path="/models/x", model_id="x")
    assert argv[argv.index("--max-input-tokens") + 1] == "1000"
    assert argv[argv.index("--max-total-tokens") + 1] == "2048"
    with pytest.raises(ValueError, match="--num-shard 0"):
        parse_args(["--num-shard", "0"])
