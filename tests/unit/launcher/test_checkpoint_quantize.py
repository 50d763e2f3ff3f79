"""TGI's --quantize gptq/awq/marlin/compressed-tensors/fp8 must name the checkpoint's own method."""
import json

import pytest

from launcher.config import LauncherConfig, parse_args
from launcher.resolve import ModelResolutionError, check_quantization

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128,
                                                   "strategy": "group", "symmetric": True}}}}
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _model(tmp_path, quantization_config=None):
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("quantize,config", [
    ("gptq", GPTQ), ("marlin", GPTQ), ("awq", AWQ), ("marlin", AWQ),
    ("compressed-tensors", CT_W4A16), ("compressed-tensors", CT_FP8), ("fp8", CT_FP8),
    ("fp8", FP8), (None, GPTQ), (None, AWQ), (None, FP8), (None, None), ("int4", None),
    ("fp8", None),
    (None, {"quant_method": "gguf", "file_type": "Q4_K_M"}),
])
def test_a_checkpoint_of_the_kind_named_is_accepted(tmp_path, quantize, config):
    check_quantization(_model(tmp_path, config), quantize)
    launcher = parse_args(["--quantize", quantize] if quantize else [])
    # the shards read the checkpoint's own method; only tgi-py's kinds are theirs to apply (fp8
    # is both: over an FP8 checkpoint the shard serves it as stored)
    assert launcher.shard_quantize == (quantize if quantize in ("int4", "fp8") else None)


def test_a_checkpoint_kind_runs_wherever_the_shards_do():
    assert LauncherConfig(quantize="gptq", device="cuda").shard_quantize is None


def test_fp8_quantizes_on_any_device_where_int8_and_int4_stay_on_the_cpu():
    assert LauncherConfig(quantize="fp8", device="cuda").shard_quantize == "fp8"
    for kind in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"--quantize {kind} runs CPU kernels only"):
            LauncherConfig(quantize=kind, device="cuda")


@pytest.mark.parametrize("quantize,config,sentence", [
    ("gptq", None, "--quantize gptq serves a checkpoint quantized by gptq, but its "
                   "quantization_config is not in config.json"),
    ("awq", GPTQ, "--quantize awq, but the checkpoint's quantization_config.quant_method is "
                  "gptq: give --quantize gptq"),
    ("fp8", CT_W4A16, "quant_method is compressed-tensors: give --quantize compressed-tensors"),
    ("int8", GPTQ, "--quantize int8 quantizes an unquantized checkpoint"),
    (None, {**GPTQ, "bits": 3}, "quantization_config.bits 3 is not served"),
    ("gptq", {**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    (None, {**AWQ, "version": "gemv"}, "quantization_config.version 'gemv' is not served"),
    (None, {"quant_method": "exl2", "bits": 4.0}, "quantization_config.quant_method 'exl2'"),
    (None, {"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quantization_config.quant_method 'bitsandbytes' is not served"),
    (None, {**CT_W4A16, "format": "marlin-24"}, "quantization_config.format 'marlin-24'"),
])
def test_a_checkpoint_that_cannot_be_served_so_is_refused_in_one_sentence(tmp_path, quantize,
                                                                          config, sentence):
    with pytest.raises(ModelResolutionError) as refused:
        check_quantization(_model(tmp_path, config), quantize)
    message = str(refused.value)
    assert sentence in message and message.count(". ") == 0, message


@pytest.mark.parametrize("kind", ["eetq", "exl2", "bitsandbytes-nf4"])
def test_tgis_kinds_without_kernels_stay_refused(kind):
    with pytest.raises(ValueError, match=f"--quantize {kind} is not one of int8, int4"):
        parse_args(["--quantize", kind])
