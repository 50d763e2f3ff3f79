"""The start-up check of Triton's kernels: each run once on the model's shapes, refused when wrong.

Interpreted on CPUs (float16 and float32: the interpreter's bf16 products are not the card's).
"""
import pytest
import torch

from shard.kernels import decode_backend, layer_ops
from shard.kernels.triton_probe import AttentionShape, attention_shapes, problem
from shard.kv_budget import KVCacheSpec

CPU = torch.device("cpu")
SHAPES = [AttentionShape(4, 2, 16, False, None), AttentionShape(4, 4, 32, True, 30.0)]


@pytest.fixture
def triton(triton_kernel):
    """Triton's kernels, importable and interpreted (skips where Triton is missing)."""
    if triton_kernel.device != "cpu":
        pytest.skip("runs the interpreter's CPU tensors")


@pytest.mark.parametrize("dtype,int8", [(torch.float16, False), (torch.float32, False),
                                        (torch.float16, True)])
def test_the_kernels_agree_with_pytorch_on_the_models_shapes(triton, dtype, int8):
    assert problem(SHAPES, 4, dtype, int8, CPU) is None


def test_a_kernel_that_answers_wrong_or_fails_to_build_is_named(triton, monkeypatch):
    from shard.kernels import triton_attention, triton_prefill

    monkeypatch.setattr(triton_prefill, "paged_prefill_attention",
                        lambda q, *args, **options: torch.zeros(q.shape[0], q.shape[1] * q.shape[2],
                                                                dtype=q.dtype))
    found = problem(SHAPES[:1], 4, torch.float32, False, CPU)
    assert found.startswith("4 heads over 2, head size 16, float32: prefill attention over a "
                            "cached prefix is off by")

    def out_of_resources(*args, **options):
        raise RuntimeError("out of resource: shared memory, Required: 233472, Hardware limit: "
                           "232448")

    monkeypatch.setattr(triton_attention, "paged_decode_attention", out_of_resources)
    assert "RuntimeError: out of resource: shared memory" in problem(SHAPES[1:], 4, torch.float16,
                                                                     True, CPU)


def test_the_shapes_come_from_the_models_layers(tiny_llama):
    from shard.distributed import ParallelContext
    from shard.loader import load_model

    loaded = load_model(tiny_llama, dtype=torch.float32, device=CPU, parallel=ParallelContext())
    config = loaded.config
    assert attention_shapes(loaded.model) == [AttentionShape(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, False, None)]
    assert attention_shapes(torch.nn.Linear(2, 2)) == []


def test_a_refusal_turns_every_triton_kernel_off(monkeypatch):
    """As on a card whose check failed: decode, prefill and the layer ops go back to PyTorch."""
    from shard.kernels import triton_probe

    monkeypatch.setattr(decode_backend, "_refusals", [])
    monkeypatch.setattr(decode_backend, "select",
                        lambda device, dtype: None if decode_backend._refusals
                        else decode_backend.TRITON)
    monkeypatch.setattr(triton_probe, "problem", lambda *args: "decode attention is off by 3")
    spec = KVCacheSpec(2, 2, 16, 4, torch.bfloat16, CPU)
    assert decode_backend.select_checked(spec, torch.nn.Linear(2, 2)) is None
    assert decode_backend.triton_refused() == "decode attention is off by 3"
    assert decode_backend.triton_kernel() is None
    cuda_like = torch.empty(0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert layer_ops._on_cuda(cuda_like) is None
    decode_backend.triton_kernel.cache_clear()  # what the next test finds: no refusal
