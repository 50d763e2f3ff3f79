"""A tiny Llama (and Qwen3-MoE) quantized by GPTQ, AWQ or compressed-tensors serves the logits of
its dequantized weights."""
import pytest
import torch
import torch.nn.functional as F

from shard.decode_paths.c_step import c_matmul
from shard.layers.checkpoint_quants import FloatRows, integer_rows
from shard.layers.ggml_quants import BlockStack
from shard.layers.linear import LinearWeight, c_int4_runs, c_int8_runs, linear
from shard.quantization_report import describe, served_types
from tests.quantized_checkpoints import quantized_model
from tests.engine_helpers import prefill_logits
from tests.tiny_models import build_tiny_model

SCHEMES = {"gptq-act-order": dict(method="gptq", act_order=True),
           "gptq-8bit": dict(method="gptq", bits=8),
           "awq": dict(method="awq")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    source = build_tiny_model(root / "source")
    made = {}
    for name, scheme in SCHEMES.items():
        quantized_model(source, root / name, root / f"{name}-reference", **scheme)
        made[name] = root / name, root / f"{name}-reference"
    return made


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_float32_logits_are_the_dequantized_models(checkpoints, scheme):
    quantized, reference = checkpoints[scheme]
    loaded, ours = prefill_logits(quantized, torch.float32)
    _, expected = prefill_logits(reference, torch.float32)
    assert (ours - expected).abs().max() <= 1e-4
    served = served_types(loaded.model)
    assert len(served) == 1 and sum(sum(forms.values()) for forms in served.values()) == 3 * 4
    line = describe(loaded.model, loaded.quantization_config, None)
    method = SCHEMES[scheme]["method"]
    bits = SCHEMES[scheme].get("bits", 4)
    assert line == f"{method} {bits}-bit g32: 12 layers (dequantized per layer)"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_bf16_logits_stay_within_bf16_rounding(checkpoints, scheme):
    quantized, reference = checkpoints[scheme]
    loaded, ours = prefill_logits(quantized, torch.bfloat16)
    _, bf16 = prefill_logits(reference, torch.bfloat16)
    _, expected = prefill_logits(reference, torch.float32)
    assert (ours - expected).abs().max() <= 2 * (bf16 - expected).abs().max() + 1e-2
    if c_int4_runs() and scheme != "gptq-8bit":
        line = describe(loaded.model, loaded.quantization_config, None)
        # act order: q/k/v and gate/up permute their inputs each their own way
        assert "(int4 kernel)" in line, line
        if scheme == "gptq-act-order":
            assert "(dequantized per layer)" in line, line


def _rows(seed: int, *, act_order: bool):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (64, 128), generator=generator)
    scale = torch.rand(64, 4, generator=generator).half().float()
    zero = torch.randint(0, 16, (64, 4), generator=generator)
    ids = torch.arange(128) // 32
    if act_order:
        ids = ids[torch.randperm(128, generator=generator)]
    return integer_rows("GPTQ-4bit-g32", 4, q, scale, zero, ids)


@pytest.mark.skipif(not c_int4_runs(), reason="the C int4 kernel does not run here")
def test_an_act_order_layer_permutes_its_inputs_into_the_int4_form():
    rows = _rows(0, act_order=True)
    prepared = LinearWeight.prepare(rows, model_dtype=torch.bfloat16)
    assert prepared.int4_form is not None and prepared.input_order is not None
    assert c_matmul(prepared) is None  # the C decode step multiplies inputs as they come
    x = torch.randn(3, 128).to(torch.bfloat16)
    expected = F.linear(x.float(), rows.dequantize())
    # the kernel rounds activations to int8 per 32 inputs (docs/models.md): an error that scales
    # with the largest output, not with each element
    error = (linear(x, prepared).float() - expected).abs().max()
    assert error <= 0.01 * expected.abs().max(), error


def test_fused_parts_in_different_orders_are_dequantized_per_call():
    stack = BlockStack((_rows(1, act_order=True), _rows(2, act_order=True)))
    prepared = LinearWeight.prepare(stack, model_dtype=torch.bfloat16)
    assert prepared.blocks is stack and prepared.input_order is None
    x = torch.randn(2, 128)
    assert torch.equal(linear(x, prepared), F.linear(x, stack.dequantize()))
    same = BlockStack((_rows(3, act_order=False), _rows(4, act_order=False)))
    if c_int4_runs():
        assert LinearWeight.prepare(same, model_dtype=torch.bfloat16).int4_form is not None


def test_fp8_rows_are_dequantized_per_call_in_the_activations_dtype():
    data = (torch.randn(32, 64) * 40).to(torch.float8_e4m3fn)
    rows = FloatRows("FP8-channel", data, torch.rand(32, 1) + 0.5, 64)
    prepared = LinearWeight.prepare(rows, model_dtype=torch.bfloat16)
    assert prepared.blocks is not None and prepared.block_kinds == ("FP8-channel",)
    x = torch.randn(2, 64)
    assert torch.equal(linear(x, prepared), F.linear(x, data.float() * rows.scale))


@pytest.mark.parametrize("method,bits", [("gptq", 4), ("compressed-tensors", 8)])
def test_quantized_experts_serve_their_dequantized_models_logits(tmp_path, method, bits):
    """Qwen3-MoE's experts quantized one by one: held quantized, each rank's own, as dense layers."""
    from tests.parity.test_qwen3_parity import build_tiny_qwen3

    source = build_tiny_qwen3(tmp_path / "source", moe=True)
    quantized_model(source, tmp_path / "q", tmp_path / "reference", method=method, bits=bits)
    loaded, ours = prefill_logits(tmp_path / "q", torch.float32)
    _, expected = prefill_logits(tmp_path / "reference", torch.float32)
    assert (ours - expected).abs().max() <= 1e-5
    # layers 0 and 2 sparse (4 experts' gate_up and down), layer 1 dense, attention in all 3
    line = describe(loaded.model, loaded.quantization_config, None)
    assert line == f"{method} {bits}-bit g32: {2 * 4 * 2 + 2 + 3 * 2} layers (dequantized per layer)"
    loaded, ours = prefill_logits(tmp_path / "q", torch.bfloat16)
    _, bf16 = prefill_logits(tmp_path / "reference", torch.bfloat16)
    assert (ours - expected).abs().max() <= 2 * (bf16 - expected).abs().max() + 1e-2
    kernel = c_int4_runs() if bits == 4 else c_int8_runs()
    if kernel:
        line = describe(loaded.model, loaded.quantization_config, None)
        assert line == f"{method} {bits}-bit g32: 24 layers (int{bits} kernel)", line
