"""Hostile adapter files: each refused with a short reason before its tensors are read."""
import json
import math
import struct

import pytest
import torch
from safetensors.torch import save_file

from shard.adapters.peft_files import AdapterError, ModuleShape, read_adapter

PREFIX = "base_model.model."
MODULES = {f"model.layers.{i}.self_attn.{kind}": ModuleShape(16, 16)
           for i in range(2) for kind in ("q_proj", "v_proj")}


def _pair(module: str, rank: int = 4, dtype=torch.float32) -> dict:
    return {f"{PREFIX}{module}.lora_A.weight": torch.full((rank, 16), 0.5).to(dtype),
            f"{PREFIX}{module}.lora_B.weight": torch.full((16, rank), 0.5).to(dtype)}


def _adapter(tmp_path, tensors=None, **config):
    tensors = tensors if tensors is not None else _pair("model.layers.0.self_attn.q_proj")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


def _refused(path, words: str) -> str:
    with pytest.raises(AdapterError, match=words) as refused:
        read_adapter(path, MODULES, max_rank=64)
    message = str(refused.value)
    assert len(message) < 1000
    return message


def test_patterns_are_matched_and_applied(tmp_path):
    tensors = {**_pair("model.layers.0.self_attn.q_proj"),
               **_pair("model.layers.1.self_attn.v_proj", rank=8)}
    adapter = read_adapter(_adapter(tmp_path, tensors, rank_pattern={
        "(.*.*)*x": 2, "layers\\.1\\..*v_proj": 8}, alpha_pattern={"v_proj": 32}),
        MODULES, max_rank=64)
    assert adapter.modules["model.layers.0.self_attn.q_proj"].scaling == 2.0
    assert adapter.modules["model.layers.1.self_attn.v_proj"].scaling == 4.0
    assert adapter.target_modules == ["q_proj", "v_proj"]


def test_a_pattern_key_beyond_the_matcher_is_refused_by_name(tmp_path):
    message = _refused(_adapter(tmp_path, rank_pattern={"(?=q)q_proj": 4}), "lookaround")
    assert "'(?=q)q_proj'" in message


def test_a_header_that_claims_more_than_any_adapter_holds(tmp_path):
    path = _adapter(tmp_path)
    with open(path / "adapter_model.safetensors", "r+b") as file:
        file.write(struct.pack("<Q", 1 << 40))
    _refused(path, "a header of 1099511627776 bytes")


def test_more_tensors_than_the_model_has_modules_for(tmp_path):
    tensors = {}
    for i in range(6):
        tensors.update(_pair(f"model.layers.{i}.self_attn.q_proj"))
    _refused(_adapter(tmp_path, tensors), "12 tensors; a LoRA adapter of this model has at most 8")


@pytest.mark.parametrize("module, words", [
    ("model.layers.0." + "a." * 2000 + "q_proj", "is not a LoRA A or B weight"),
    ("model.layers.0." + "a." * 200 + "q_proj", "not a projection of this model"),
    ("model.layers.0.mlp\n.q_proj", "mlp\\\\n.q_proj.lora_A.weight' is not a LoRA"),
])
def test_a_module_the_model_lacks_is_named_briefly(tmp_path, module, words):
    _refused(_adapter(tmp_path, _pair(module)), words)


def test_tensors_that_do_not_fit_the_model(tmp_path):
    _refused(_adapter(tmp_path, _pair("model.layers.0.self_attn.q_proj", dtype=torch.int32)),
             "holds I32, not floats")
    _refused(_adapter(tmp_path, _pair("model.layers.0.self_attn.q_proj", rank=128), r=128),
             "ranks up to 64")
    wide = {f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
            f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(16, 4)}
    _refused(_adapter(tmp_path, wide), "trained on another base model")
    _refused(_adapter(tmp_path, rank_pattern={"q_proj": 2}), "has rank 4, its config says 2")


@pytest.mark.parametrize("config, words", [
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ({"rank_pattern": {"q_proj": "8"}}, "must be a positive integer"),
    ({"alpha_pattern": {"q_proj": True}}, "must be a number"),
    ({"lora_alpha": math.inf}, "lora_alpha must be a finite number"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_config_values_are_checked(tmp_path, config, words):
    _refused(_adapter(tmp_path, **config), words)


def test_configs_no_peft_writes(tmp_path):
    path = _adapter(tmp_path)
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    _refused(path, "not readable JSON")
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "pad": "x" * (1 << 20)}))
    _refused(path, "over 1048576 bytes")
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8,
                                                          "base_model_name_or_path": "\ud800"}))
    assert read_adapter(path, MODULES, max_rank=64).base_model.encode("utf-8") == b"\\ud800"


def test_a_pickle_larger_than_any_adapter_of_the_model_is_not_read(tmp_path):
    path = _adapter(tmp_path)
    (path / "adapter_model.safetensors").unlink()
    largest = sum(8 * 64 * (m.inputs + m.outputs) for m in MODULES.values()) + (1 << 20)
    (path / "adapter_model.bin").write_bytes(b"\0" * (largest + 1))
    _refused(path, "more than any LoRA adapter of rank up to 64 on this model holds")
