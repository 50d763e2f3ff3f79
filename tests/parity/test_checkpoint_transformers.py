"""Quantized checkpoints written by their formats' own code serve the logits transformers loads.

compressed-tensors checkpoints are written by the compressed-tensors library (its scales from
its calculate_qparams, its ModelCompressor packing them), FP8 ones by transformers' own
FineGrainedFP8 quantizing op; transformers loads each on the CPU by dequantizing it
(CompressedTensorsConfig(dequantize=True); a FineGrainedFP8 checkpoint dequantizes by itself
without a GPU). GPTQ and AWQ are not here: transformers loads them only through the compiled
gptqmodel package (tests/unit/shard/test_checkpoint_models.py checks them against their specs).
"""
import json
import shutil

import pytest
import torch

from tests.engine_helpers import prefill_logits
from tests.tiny_models import build_tiny_model

PROMPT = (5, 17, 42, 99, 3, 25, 7, 11, 30)
SCHEMES = {
    # W4A16 as llm-compressor writes it, asymmetric: weight_zero_point packed too
    "w4a16-asym-g32": dict(num_bits=4, type="int", symmetric=False, strategy="group",
                           group_size=32),
    "w8a16-channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8-channel": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
    "fp8-tensor": dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("source") / "model")


@pytest.fixture(scope="module")
def unquantized(source):
    return _transformers_logits(source)


def _check(ours, expected, unquantized):
    """Within 1e-4 of transformers, where rounding the weights moved the logits far more."""
    error = (ours - expected).abs().max()
    assert error <= 1e-4 and (expected - unquantized).abs().max() > 10 * error


def _with_tokenizer(source, out):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def write_compressed_tensors(source, out, scheme: dict):
    """`source` quantized by compressed-tensors itself: min/max scales, its compressor's format."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, QuantizationStatus,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    args = QuantizationArgs(**scheme)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=args)}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if args.strategy == "group":
            weight = weight.reshape(weight.shape[0], -1, args.group_size)
        dims = (-1,) if args.strategy != "tensor" else (0, 1)
        scale, zero = calculate_qparams(weight.amin(dim=dims), weight.amax(dim=dims), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
            module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(
        model, "float-quantized" if args.type == "float" else "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return _with_tokenizer(source, out)


def write_finegrained_fp8(source, out, block: int = 32):
    """`source`'s linear weights in FP8 blocks by transformers' own quantizing op."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quant_config = transformers.FineGrainedFP8Config(weight_block_size=(block, block))
    op = Fp8Quantize(type("Quantizer", (), {"quantization_config": quant_config})())
    tensors = {}
    for name, value in load_file(str(source / "model.safetensors")).items():
        linear = name.endswith("_proj.weight")
        tensors.update(op.convert({name: value}) if linear else {name: value})
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(config))
    return _with_tokenizer(source, out)


def _transformers_logits(model_dir, **kwargs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kwargs).eval()
    for module in model.modules():  # dequantized on load: plain linear layers remain
        assert not hasattr(module, "weight_packed") and module.__class__.__name__ != "FP8Linear"
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


# transformers warns that the checkpoint's own quantization_config is kept beside dequantize
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_checkpoints_serve_transformers_logits(source, unquantized, tmp_path,
                                                                  scheme):
    import transformers

    quantized = write_compressed_tensors(source, tmp_path / scheme, SCHEMES[scheme])
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    expected = _transformers_logits(
        quantized, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    _, ours = prefill_logits(quantized, torch.float32, PROMPT)
    _check(ours, expected, unquantized)


def test_finegrained_fp8_checkpoints_serve_transformers_logits(source, unquantized, tmp_path):
    quantized = write_finegrained_fp8(source, tmp_path / "fp8")
    expected = _transformers_logits(quantized)
    _, ours = prefill_logits(quantized, torch.float32, PROMPT)
    _check(ours, expected, unquantized)
