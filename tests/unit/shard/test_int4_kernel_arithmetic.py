"""The C int4 matmul's integer forms (AVX-512 VNNI, AVX2, AVX-VNNI) against their arithmetic."""
import numpy as np
import pytest
import torch

from shard.kernels import bf16_matmul, int4_matmul
from tests.kernel_builds import integer_library
from tests.unit.shard.test_int4_kernel import compact_factors
from tests.unit.shard.test_int8_kernel_arithmetic import ROWS, fma

# below this largest magnitude 127 / largest is no float, and a group rounds in float64 instead
SMALLEST_FLOAT_GROUP = float(np.float32(127.0) / np.float32(3.4e38))


@pytest.fixture
def int4_library(integer_build):
    """The C int4 matmul in each build that multiplies in integers."""
    return integer_library(int4_matmul, integer_build,
                           lambda library: library.int4_matmul_supported())


def expected(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """The VNNI tiles' arithmetic in PyTorch.

    Each row's group of 32 rounded to int8: its inputs times 127 / largest (a float64 quotient
    rounded to float32) in float32, to nearest even; d and X = d x (sum of xq) in float32, D =
    sum q xq exact, then per group in order sums = fma(scale * d, D, sums) and fma(low, X, sums);
    the bias added in float32, one rounding to bf16."""
    rows, k = x.shape
    values = x.float().reshape(rows, k // 32, 32)
    top = values.abs().amax(dim=-1)
    assert bool((top >= SMALLEST_FLOAT_GROUP).all())
    # 127 / top as one division (a scalar over a tensor is PyTorch's reciprocal times 127)
    inverse = (torch.full_like(top, 127.0, dtype=torch.double) / top.double()).float()
    xq = (values * inverse[..., None]).round()
    d = top / 127.0
    sums_x = d * xq.sum(dim=-1)
    dots = torch.einsum("rgi,ngi->rng", xq.double(), q.double().reshape(-1, k // 32, 32)).float()
    sums = torch.zeros(rows, q.shape[0])
    for g in range(k // 32):
        sums = fma(scale[:, g] * d[:, None, g], dots[..., g], sums)
        sums = fma(low[:, g], sums_x[:, None, g], sums)
    if bias is not None:
        sums = sums + bias.float()
    return sums.bfloat16()


def weights(mode: str, n: int, k: int) -> tuple:
    """A random weight packed in `mode`: (packed, q, scale, low), the factors in float32."""
    if mode == "F":
        q, scale, low = int4_matmul.quantize(torch.randn(n, k))
        return int4_matmul.pack(q, scale, low), q, scale, low
    factors = compact_factors(mode, n, k)
    if mode == "K":
        return (int4_matmul.pack_k(*factors), factors[0],
                *int4_matmul.k_factors(*factors[1:]))
    q, scale, low = factors
    return int4_matmul.pack_half(*factors), q, scale.float(), low.float()


@pytest.mark.parametrize("mode", ["F", "K", "Q4_0", "Q4_1"])
def test_every_integer_form_computes_the_vnni_arithmetic_bit_for_bit(mode, int4_library):
    """AVX2's VPMADDUBSW, AVX-VNNI's VPDPBUSD and AVX-512's VPDPBUSD give the same bf16 results.

    Every factor mode, every tile (1, 2, 4, 8 rows on AVX-512; 1, 2, 4 on AVX2) and more rows,
    tails of a 16-feature block, bias or none: `expected`'s results bit for bit."""
    torch.manual_seed(22)
    packed, q, scale, low = weights(mode, 40, 512)
    for bias in (None, torch.randn(40).bfloat16()):
        for rows in ROWS:
            x = torch.randn(rows, 512).bfloat16()
            out = bf16_matmul.run_on_rows(int4_library.int4_matmul, x, packed, 40, bias)
            assert torch.equal(out, expected(x, q, scale, low, bias)), (mode, rows)
