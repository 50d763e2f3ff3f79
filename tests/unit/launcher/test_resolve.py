import json

import pytest

from launcher.config import parse_args
from launcher.resolve import ModelResolutionError, resolve_model


def test_local_directory_is_used_as_it_is(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama


def test_incomplete_directory_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ModelResolutionError, match=r"lacks \*\.safetensors, tokenizer\.json"):
        resolve_model(str(tmp_path))


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelResolutionError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_offline_unknown_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelResolutionError, match="neither a local model directory nor a .gguf"):
        resolve_model("someone/not-a-cached-model")


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
