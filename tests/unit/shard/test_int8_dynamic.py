"""An encoder's --quantize int8: fbgemm's int8 matmul, its outlier rows, and where it is refused."""
import pytest
import torch
import torch.nn.functional as F

from shard.layers import int8_dynamic
from shard.layers.int8_dynamic import KIND, encoder_quantize, pack
from shard.layers.linear import LinearWeight, linear


def _layer(out_features=48, in_features=64):
    torch.manual_seed(0)
    return torch.randn(out_features, in_features) * 0.05, torch.randn(out_features)


def _rows(count=40, in_features=64, *, outliers=()):
    torch.manual_seed(1)
    x = torch.randn(count, in_features)
    for row in outliers:  # one feature far larger, as BERT's [CLS] row carries
        x[row, 3] = 60.0
    return x


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def test_a_layer_gives_f_linear_within_int8_rounding_and_leaves_x_as_it_was():
    weight, bias = _layer()
    prepared = LinearWeight.prepare(weight, bias, KIND, torch.float32)
    assert prepared.form == "int8" and prepared.multiplies_quantized
    assert prepared.weight is None  # the packed int8 form alone is held
    x = _rows(outliers=(0, 17))
    before = x.clone()
    out = linear(x, prepared)
    assert torch.equal(x, before)  # outlier rows are zeroed for a call, then put back
    reference = F.linear(x, weight, bias)
    assert out.shape == reference.shape and out.dtype == torch.float32
    # measured 0.99995 at the least; a missing bias or a wrong scale is far off
    assert _cosines(out, reference).min() > 0.9995
    assert (out - reference).abs().max() < 0.05 * reference.abs().max()
    half = linear(x.to(torch.bfloat16), prepared)
    assert half.dtype == torch.bfloat16 and _cosines(half.float(), reference).min() > 0.999
    batched = linear(x.view(5, 8, 64), prepared)  # any leading shape
    assert batched.shape == (5, 8, 48)


def test_outlier_rows_are_multiplied_on_their_own(monkeypatch):
    """The other rows come out as they would without the outliers in the batch, bit for bit
    (their own range sets the rounding step); with one step for all, they lose most digits."""
    weight, bias = _layer()
    w = pack(weight, bias)
    outliers = [0, 9, 31]
    x = _rows(outliers=outliers)
    others = [i for i in range(len(x)) if i not in outliers]
    out = int8_dynamic.linear(x, w)
    assert torch.equal(out[others], int8_dynamic.linear(x[others], w))
    assert torch.equal(out[outliers], int8_dynamic.linear(x[outliers], w))
    reference = F.linear(x, weight, bias)
    split_error = (out[others] - reference[others]).abs().max()
    monkeypatch.setattr(int8_dynamic, "OUTLIER_FACTOR", float("inf"))  # one call for all rows
    single_error = (int8_dynamic.linear(x, w)[others] - reference[others]).abs().max()
    assert single_error > 4 * split_error, (single_error, split_error)


def test_without_avx512_vnni_activations_take_7_bits(monkeypatch):
    """Where fbgemm sums pairs of products in 16 bits (no VNNI), activations are rounded to 7
    bits so that no sum overflows: twice the step, still the layer's answer."""
    weight, bias = _layer()
    w = pack(weight, bias)
    x = _rows()
    full = int8_dynamic.linear(x, w)
    monkeypatch.setattr(int8_dynamic, "_full_range", lambda: False)
    reduced = int8_dynamic.linear(x, w)
    reference = F.linear(x, weight, bias)
    assert not torch.equal(full, reduced)
    assert _cosines(reduced, reference).min() > 0.999
    assert (reduced - reference).abs().mean() > (full - reference).abs().mean()


def test_an_encoders_int8_is_fbgemms_and_other_kinds_pass_through():
    assert encoder_quantize("int8") == KIND
    assert encoder_quantize(None) is None and encoder_quantize("fp8") == "fp8"


def test_a_pytorch_without_fbgemm_is_refused_with_the_reason(monkeypatch):
    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("this PyTorch has no other quantized engine to switch to")
    monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")  # as on ARM builds
    with pytest.raises(ValueError, match="quantized engine is 'qnnpack'.*without --quantize"):
        encoder_quantize("int8")
