"""tgi-launcher refuses a model whose architecture the shards do not serve before any process
starts, with the sentence a shard would die with, naming the architectures served."""
import json

import pytest

from launcher import __main__ as launcher_cli
from launcher.shard_group import LaunchError
from launcher.supervisor import check_shardable
from shard.models import ARCHITECTURES


def _model_dir(path, architectures):
    """What resolve_model takes for a model directory: config.json, *.safetensors, tokenizer.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": architectures, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 320}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_an_unsupported_architecture_is_refused_before_any_shard_starts(tmp_path, monkeypatch,
                                                                        capfd):
    def no_shards(*args, **kwargs):
        raise AssertionError("the launcher went on to start the shards")

    monkeypatch.chdir(tmp_path)  # no .env of the working directory
    monkeypatch.setattr(launcher_cli, "Supervisor", no_shards)
    model_dir = _model_dir(tmp_path / "gpt2", ["GPT2LMHeadModel"])
    assert launcher_cli.main(["--model-id", str(model_dir)]) == 1
    said = capfd.readouterr().err
    assert (f"architecture ['GPT2LMHeadModel'] is not supported; supported: "
            f"{sorted(ARCHITECTURES)}") in said
    assert "Phi3ForCausalLM" in said and str(model_dir / "config.json") in said


def test_the_first_served_architecture_listed_passes_and_none_listed_is_refused(tmp_path):
    check_shardable(_model_dir(tmp_path / "ok", ["GPT2LMHeadModel", "MistralForCausalLM"]), 2)
    with pytest.raises(LaunchError, match=r"architecture \[\] is not supported; supported: "):
        check_shardable(_model_dir(tmp_path / "none", []), 1)
