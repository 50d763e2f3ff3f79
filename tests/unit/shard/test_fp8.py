"""--quantize fp8: float8 e4m3 weights with a scale per output channel, activations per token.

The CPU runs the dequantizing path; it must be the arithmetic the scaled matmul does on the card
(float8 operands, float32 sums, both scales), which the last test compares where a Hopper GPU is.
"""
import pytest
import torch
import torch.nn.functional as F

from shard.layers import fp8
from shard.layers.linear import LinearWeight, linear


def _weight(out_features=48, in_features=64, seed=0):
    torch.manual_seed(seed)
    return torch.randn(out_features, in_features) * torch.linspace(0.1, 3.0, out_features)[:, None]


def test_rows_round_to_float8_within_its_precision():
    weight = _weight()
    data, scales = fp8.quantize_rows(weight)
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (48,)
    # each row's largest value lands on 448; e4m3 keeps 3 mantissa bits (half an ulp: 1/16)
    assert torch.equal(data.float().abs().amax(1), torch.full((48,), fp8.FP8_MAX))
    restored = fp8.dequantize(data, scales)
    bound = weight.abs() / 16 + scales[:, None] * 2.0 ** -10  # subnormals: half of 2^-9
    assert ((restored - weight).abs() <= bound).all()


def test_the_matmul_is_float8_operands_and_both_scales_exactly():
    weight, x = _weight(), torch.randn(5, 64)
    data, scales = fp8.quantize_rows(weight)
    x_q, x_scale = fp8.quantize_rows(x)
    want = (x_q.double() @ data.double().T) * x_scale.double()[:, None] * scales.double()
    bias = torch.randn(48)
    out = fp8.linear(x, data, scales, bias)
    torch.testing.assert_close(out.double(), want + bias.double(), rtol=1e-5, atol=1e-5)
    # and close to the unquantized product: a few float8 ulps of each operand
    exact = F.linear(x, weight, bias)
    assert (out - exact).abs().max() < 0.1 * exact.abs().max()


def test_bf16_activations_come_back_in_bf16_with_leading_dimensions():
    data, scales = fp8.quantize_rows(_weight())
    out = fp8.linear(torch.randn(2, 3, 64).bfloat16(), data, scales)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16


def test_prepare_holds_the_float8_form_alone_where_the_shape_fits():
    prepared = LinearWeight.prepare(_weight().bfloat16(), quantize_kind="fp8",
                                    model_dtype=torch.bfloat16)
    assert prepared.form == "fp8" and prepared.weight is None and prepared.multiplies_quantized
    assert prepared.quantized.data.dtype == torch.float8_e4m3fn
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(linear(x, prepared), fp8.linear(x, prepared.quantized.data,
                                                               prepared.quantized.scales))
    odd = LinearWeight.prepare(torch.randn(40, 64), quantize_kind="fp8")  # 40: not by 16
    assert odd.quantized is None and odd.form == "float32"


def test_the_scaled_matmul_runs_on_hopper_only():
    assert not fp8.scaled_mm_runs(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8.scaled_mm_runs(torch.device("cuda")),
                    reason="needs a GPU with float8 row-wise scaled matmuls (Hopper on)")
def test_the_scaled_matmul_on_the_card_is_the_dequantized_arithmetic():
    data, scales = fp8.quantize_rows(_weight(64, 128).cuda())
    x = torch.randn(7, 128, device="cuda").bfloat16()
    out = fp8.linear(x, data, scales)  # torch._scaled_mm
    x_q, x_scale = fp8.quantize_rows(x)
    want = (x_q.double() @ data.double().T) * x_scale.double()[:, None] * scales.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)  # out rounded to bf16
