"""The C int8 matmul's integer forms (AVX-512 VNNI, AVX2, AVX-VNNI) against their arithmetic."""
import pytest
import torch

from shard.kernels import bf16_matmul, int8_matmul
from tests.kernel_builds import integer_library
from tests.unit.shard.test_int8_kernel import COMPACT, compact, groups

ROWS = (1, 2, 3, 4, 5, 8, 9, 33, 130)


@pytest.fixture
def int8_library(integer_build):
    """The C int8 matmul in each build that multiplies in integers."""
    return integer_library(int8_matmul, integer_build,
                           lambda library: library.int8_matmul_supported())


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c, rounded once as a fused multiply-add rounds it.

    In float64 the product is exact (24 + 24 bits); the sum is rounded to float64 first, a second
    rounding that differs from one only at a near-tie."""
    return (a.double() * b.double() + c.double()).float()


def expected(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
             group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The VNNI tiles' arithmetic in PyTorch.

    Each row's group rounded to int8 (its largest magnitude as 127, the product in float64, to
    nearest even), d and X = d x (sum of xq) in float32, D = sum q xq exact, then per group in
    order sums = fma(scale, D * d, sums) and, where the mode has lows, fma(low, X, sums); the bias
    added in float32, one rounding to bf16."""
    rows, k = x.shape
    values = x.float().reshape(rows, k // group, group)
    top = values.abs().amax(dim=-1)
    # 127 / top as one division (a scalar over a tensor is PyTorch's reciprocal times 127)
    inverse = torch.full_like(top, 127.0, dtype=torch.double) / top.double()
    inverse = torch.where(top > 0, inverse, torch.zeros_like(inverse))
    xq = (values.double() * inverse[..., None]).round()
    d = top / 127.0
    sums_x = d * xq.sum(dim=-1).float()
    dots = torch.einsum("rgi,ngi->rng", xq, q.double().reshape(-1, k // group, group)).float()
    sums = torch.zeros(rows, q.shape[0])
    for g in range(k // group):
        sums = fma(scale[:, g], dots[..., g] * d[:, None, g], sums)
        if low is not None:
            sums = fma(low[:, g], sums_x[:, None, g], sums)
    if bias is not None:
        sums = sums + bias.float()
    return sums.bfloat16()


def test_every_integer_form_computes_the_vnni_arithmetic_bit_for_bit(int8_library):
    """AVX2's VPMADDWD, AVX-VNNI's and AVX-512's VPDPBUSD give the same bf16 results.

    Every mode and group, every tile (1, 2, 4, 8 rows on AVX-512; 1, 2, 4 on AVX2) and more rows,
    tails of a 16-feature block, bias or none, an all-zero group: `expected`'s results bit for bit,
    the same integer sums and the same float32 epilogue."""
    generator = torch.Generator().manual_seed(21)
    cases = []
    for group in (16, 32):
        q, scale, low = groups(40, 96, group, seed=group)
        cases.append((int8_matmul.pack(q, scale, low, group), q, scale, low, group))
    for mode in COMPACT:
        packed, q, scale, low, group, _ = compact(mode, 40, 512, seed=len(mode))
        cases.append((packed, q, scale, low if mode in ("HL", "HL16", "K5") else None, group))
    for packed, q, scale, low, group in cases:
        n, k = q.shape
        for bias in (None, torch.randn(n, generator=generator).bfloat16()):
            for rows in ROWS:
                x = torch.randn(rows, k, generator=generator).bfloat16()
                x[0, :group] = 0  # an all-zero group: d 0
                out = bf16_matmul.run_on_rows(int8_library.int8_matmul, x, packed, n, bias)
                assert torch.equal(out, expected(x, q, scale, low, group, bias)), (n, k, rows)
