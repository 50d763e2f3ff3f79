"""Fixtures for shard layers whose arithmetic depends on the CPU."""
import pytest

from shard.layers import arithmetic


@pytest.fixture(params=[True, False], ids=["native-bf16", "widened-bf16"])
def bf16_kernels(request, monkeypatch) -> bool:
    """Forces the CPU-capability decision both ways on any machine: "native-bf16" runs the branch an
    AVX-512 BF16 / AMX CPU takes (PyTorch computes bf16 correctly, if slowly, everywhere), and
    "widened-bf16" the AVX2 branch that computes bf16 data in float32. Only the dtype decision of
    shard.layers.arithmetic is forced; the oneDNN weight prepack needs the real instructions."""
    monkeypatch.setattr(arithmetic, "cpu_has_bf16_kernels", lambda: request.param)
    return request.param
