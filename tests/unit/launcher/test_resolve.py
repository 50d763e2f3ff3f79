"""Model id resolution: local directories, .gguf files, the default model and Hub ids."""
import json
import os

import pytest

from launcher import gguf as conversion
from launcher import prepare
from launcher.config import parse_args
from launcher.resolve import DEFAULT_MODEL_ID, ModelResolutionError, resolve_model
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
                             r"a \.gguf file, nor a model the Hugging Face Hub could provide"):
        resolve_model("someone/not-a-cached-model", cache_dir=tmp_path, hub_cache=str(tmp_path))


def test_hub_id_goes_through_snapshot_download(monkeypatch, tiny_llama, tmp_path):
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tiny_llama)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("org/model", revision="v1", cache_dir=tmp_path) == tiny_llama
    (repo_id, kwargs), = calls
    assert repo_id == "org/model" and kwargs["revision"] == "v1"
    assert "*.safetensors" in kwargs["allow_patterns"]


def test_hub_snapshot_without_safetensors_names_the_id(monkeypatch, tmp_path):
    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path))
    with pytest.raises(ModelResolutionError, match=r"Hub model 'org/bin-only'.*lacks \*\.safetensors"):
        resolve_model("org/bin-only", cache_dir=tmp_path)


@pytest.mark.parametrize("model_id", [None, DEFAULT_MODEL_ID])
def test_default_model_is_prepared_in_the_cache(monkeypatch, tiny_llama, tmp_path, model_id):
    monkeypatch.setattr(prepare, "prepare_default_model", lambda cache_dir: tiny_llama)
    assert resolve_model(model_id, cache_dir=tmp_path) == tiny_llama


def test_gguf_file_is_converted_once_per_version_of_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr(conversion, "write_tokenizer",
                        lambda gguf_path, out_dir, **kw: (out_dir / "tokenizer.json").write_text("{}"))
    gguf_path = write_tiny_gguf(tmp_path / "src" / "tiny.gguf").path
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert (first / "model.safetensors").exists()

    converted = []
    monkeypatch.setattr(prepare, "convert_gguf", lambda *a: converted.append(a) or a[1])
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache") == first
    assert converted == []
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
