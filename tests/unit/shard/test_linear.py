"""A bf16 weight multiplies to what F.linear gives in every form the CPU may hold it in."""
import pytest
import torch
import torch.nn.functional as F

from shard.kernels import bf16_matmul
from shard.layers import linear as linear_module
from shard.layers import precision
from shard.layers.linear import LinearWeight, linear
from shard.layers.precision import (activation_dtype, c_matmul_runs, compute_dtype,
                                    cpu_has_bf16_kernels)


def _weights():
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    return weight, bias


def test_prepacked_bf16_linear_equals_f_linear(monkeypatch):
    if not cpu_has_bf16_kernels():
        pytest.skip("oneDNN takes no bf16 weights on this CPU (needs AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT), so the prepack cannot run here, not even forced")
    monkeypatch.setattr(bf16_matmul, "can_pack", lambda weight: False)
    weight, bias = _weights()
    with_bias, without = LinearWeight.prepare(weight, bias), LinearWeight.prepare(weight)
    assert with_bias.packed is not None
    for rows in (1, 7, 32):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(linear(x, with_bias), F.linear(x, weight, bias))
        assert torch.equal(linear(x, without), F.linear(x, weight))


def _bf16_units(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart a and b are, element-wise (same signs assumed)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("features", [(96, 64), (100, 64), (7, 18), (1, 2), (3072, 576)])
def test_bf16_kernel_matches_onednn_to_one_unit(features):
    """The C kernel (AVX-512 BF16): every row count's tile shapes and every tail of a 16-feature
    block, with and without bias, against oneDNN's bf16 matmul (the same products, summed in
    another order) and the float32 product."""
    if not (cpu_has_bf16_kernels() and c_matmul_runs()
            and bf16_matmul.load_library().bf16_matmul_supported() == bf16_matmul.DPBF16_FORM):
        pytest.skip("the C bf16 matmul's AVX-512 BF16 form needs that CPU (no AMX) and a C "
                    "compiler")
    torch.manual_seed(1)
    n, k = features
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    differing = total = 0
    for with_bias in (None, bias):
        prepared = LinearWeight.prepare(weight, with_bias)
        assert prepared.tiled is not None and prepared.packed is None
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 130):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            out = linear(x, prepared)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            expected = torch.ops.mkldnn._linear_pointwise(x, onednn, with_bias, "none", [], "")
            same_sign = torch.sign(out) == torch.sign(expected)
            assert bool(((_bf16_units(out, expected) <= 1) & same_sign
                         | ((out - expected).abs() < 1e-6)).all())
            differing += int((out != expected).sum())
            total += out.numel()
            exact = F.linear(x.float(), weight.float(),
                             None if with_bias is None else with_bias.float())
            torch.testing.assert_close(out.float(), exact, rtol=1 / 128, atol=k * 1e-3)
    assert differing <= total // 100


def test_bf16_kernel_takes_any_row_layout():
    if not c_matmul_runs():
        pytest.skip("the C bf16 matmul needs AVX-512 BF16 (and no AMX) or AVX2, and a C compiler")
    weight, bias = _weights()
    prepared = LinearWeight.prepare(weight, bias)
    batch = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out = linear(batch, prepared)
    assert out.shape == (2, 5, 96)
    assert torch.equal(out[1], linear(batch[1], prepared))
    strided = batch[:, 2]  # rows 5 * 64 apart
    assert torch.equal(linear(strided, prepared), linear(strided.contiguous(), prepared))
    assert linear(batch[:, :0], prepared).shape == (2, 0, 96)
    # a weight that is a transposed view packs as its contiguous copy does
    transposed = weight.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert torch.equal(linear(batch, LinearWeight.prepare(transposed, bias)), out)
    # float32 activations are rounded to bf16 and come back float32
    wide = linear(batch[0].float(), prepared)
    assert wide.dtype == torch.float32 and torch.equal(wide, out[0].float())


def test_odd_input_widths_keep_onednn():
    if not cpu_has_bf16_kernels():
        pytest.skip("oneDNN takes no bf16 weights on this CPU")
    prepared = LinearWeight.prepare(torch.randn(8, 7, dtype=torch.bfloat16))
    assert prepared.tiled is None and prepared.packed is not None


@pytest.mark.parametrize("rows", [1, 3, 7, 32, 48, 49, 200])
def test_bf16_without_bf16_kernels_computes_in_float32(monkeypatch, rows):
    """The AVX2 path without our C matmul (forced here on any CPU): the bf16 matrix-vector
    product for one row, float16-packed weights for other decode-size matmuls, a float32 copy for
    prefill-size ones."""
    monkeypatch.setattr(linear_module, "cpu_has_bf16_kernels", lambda: False)
    monkeypatch.setattr(linear_module, "c_matmul_runs", lambda: False)  # no C compiler there
    weight, bias = _weights()
    prepared = LinearWeight.prepare(weight, bias)
    assert prepared.packed is None and prepared.widened.dtype == torch.float32
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = F.linear(x.float(), weight.float(), bias.float())
    out = linear(x, prepared)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    # within one bf16 rounding of the float32 result (F.linear in bf16 gives the same bound)
    torch.testing.assert_close(out.float(), expected, rtol=1 / 128, atol=1e-2)
    torch.testing.assert_close(linear(x, LinearWeight.prepare(weight)).float(),
                               F.linear(x.float(), weight.float()), rtol=1 / 128, atol=1e-2)
    # float32 activations (what models hold on such CPUs) stay float32, and only one row (the bf16
    # matrix-vector product) rounds them to bf16
    wide = linear(x.float(), prepared)
    assert wide.dtype == torch.float32
    if rows == 1:
        torch.testing.assert_close(wide, expected, rtol=1 / 128, atol=1e-2)
    else:
        torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-4)


def test_float32_weights_are_used_as_they_are():
    weight = torch.randn(8, 8)
    prepared = LinearWeight.prepare(weight)
    assert prepared.packed is None and prepared.half is None and prepared.widened is None
    x = torch.randn(3, 8)
    assert torch.equal(linear(x, prepared), F.linear(x, weight))


def test_compute_dtype_widens_bf16_only_where_the_cpu_lacks_kernels(bf16_kernels):
    cpu = torch.device("cpu")
    assert compute_dtype(torch.float32, cpu) == torch.float32
    assert compute_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if bf16_kernels else torch.float32)
    # GPUs compute bf16 themselves, whatever the host CPU does
    assert compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_activations_stay_bf16_where_our_matmul_takes_them(bf16_kernels, monkeypatch):
    cpu = torch.device("cpu")
    assert activation_dtype(torch.float32, cpu) == torch.float32
    assert activation_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if bf16_kernels
                                                    else torch.float32)
    # an AVX2 CPU where the C matmul runs: bf16 activations, but PyTorch's own matmuls (attention)
    # still widen to float32
    monkeypatch.setattr(precision, "c_matmul_runs", lambda: True)
    assert activation_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert compute_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if bf16_kernels
                                                 else torch.float32)
    assert activation_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


@pytest.fixture
def avx2_matmul(avx2_build):
    """The C matmul as an AVX2-only CPU builds it (-march=x86-64-v3), on any CPU that runs AVX2."""
    bf16_matmul.load_library.cache_clear()
    library = bf16_matmul.load_library()
    if library is None:
        bf16_matmul.load_library.cache_clear()
        pytest.skip("no C compiler here")
    yield library
    bf16_matmul.load_library.cache_clear()


@pytest.mark.parametrize("features", [(96, 64), (100, 64), (7, 18), (1, 2), (3072, 576), (33, 1536)])
def test_the_avx2_form_rounds_the_float32_product_once(avx2_matmul, features):
    """Every row count's tiles (3, 2 and 1 rows; 1-3 blocks; 6-row panel tiles from 24 rows) and
    every tail of a block, with and without bias, more rows than one pass takes, against the exact
    product: float32 sums of exact products, rounded once to bf16, so all but rare elements equal
    the exact value's rounding."""
    assert avx2_matmul.bf16_matmul_supported() == bf16_matmul.AVX2_FORM
    torch.manual_seed(2)
    n, k = features
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    packed = bf16_matmul.pack(weight)
    differing = total = 0
    for with_bias in (None, bias):
        for rows in (1, 2, 3, 4, 5, 6, 7, 9, 16, 31, 130, 260):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            out = bf16_matmul.matmul(x, packed, n, with_bias)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            exact = x.double() @ weight.double().T
            if with_bias is not None:
                exact += with_bias.double()
            scale = (x.double().abs() @ weight.double().abs().T) * k * 2.0 ** -24
            assert bool(((out.double() - exact).abs() <= exact.abs() / 256 + scale).all())
            differing += int((out != exact.to(torch.bfloat16)).sum())
            total += out.numel()
            # prefill-size calls take the panel tiles, small ones the direct tiles: the same sums
            # in the same order, so a row's result does not depend on the call's row count
            assert torch.equal(out[:5], bf16_matmul.matmul(x[:5], packed, n, with_bias))
    assert differing <= total // 100


def test_the_avx2_form_keeps_nan_and_infinity(avx2_matmul):
    weight = torch.ones(16, 4, dtype=torch.bfloat16)
    packed = bf16_matmul.pack(weight)
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0], [float("inf"), 1.0, 0.0, 0.0],
                      [3.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    out = bf16_matmul.matmul(x, packed, 16, None)
    assert bool(out[0].isnan().all()) and bool((out[1] == float("inf")).all())
    assert bool((out[2] == 3.0).all())
