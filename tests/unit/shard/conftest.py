"""Fixtures for shard layers whose arithmetic depends on the CPU."""
import pytest

from shard.layers import arithmetic


@pytest.fixture(params=[True, False], ids=["native-bf16", "widened-bf16"])
def bf16_kernels(request, monkeypatch) -> bool:
    """Forces the CPU-capability decision both ways on any machine: "native-bf16" runs the branch an
    AVX-512 BF16 / AMX CPU takes (PyTorch computes bf16 correctly, if slowly, everywhere), and
    "widened-bf16" the branch of an AVX2 CPU without our C matmul, which computes bf16 data in
    float32. Only the dtype decisions of shard.layers.arithmetic are forced; the oneDNN weight
    prepack needs the real instructions."""
    monkeypatch.setattr(arithmetic, "cpu_has_bf16_kernels", lambda: request.param)
    if not request.param:  # nor our C matmul, which would keep bf16 activations on AVX2
        monkeypatch.setattr(arithmetic, "c_matmul_runs", lambda: False)
    return request.param
