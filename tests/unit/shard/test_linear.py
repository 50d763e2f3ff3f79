"""Prepacked bfloat16 weights give exactly what F.linear gives; float32 is left to F.linear."""
import pytest
import torch
import torch.nn.functional as F

from shard.layers.linear import linear, prepack


def test_prepacked_bf16_linear_equals_f_linear():
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    packed = prepack(weight)
    if packed is None:
        pytest.skip("this CPU has no oneDNN bfloat16 matmul")
    for rows in (1, 7, 32):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(linear(x, weight, bias, packed), F.linear(x, weight, bias))
        assert torch.equal(linear(x, weight, None, packed), F.linear(x, weight))


def test_float32_is_not_prepacked():
    assert prepack(torch.randn(8, 8)) is None
