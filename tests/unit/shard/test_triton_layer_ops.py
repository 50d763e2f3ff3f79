"""The Triton layer ops of CUDA against PyTorch's forms (interpreted on CPUs, compiled on GPUs).

The residual add with its RMS norm, and the rotary with the KV cache write (an int8 cache's
quantization included), each one launch: the same values as the PyTorch ops they replace, rounded
where those round. float16 stands for bf16 (see test_triton_attention).
"""
import pytest
import torch

from shard.kernels import layer_ops
from shard.layers import kv_int8
from shard.layers.rotary import RotaryAngles, apply_rotary
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion

HEADS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE = 6, 2, 8, 4


def _pytorch_norm(x, weight, eps, residual):
    """layer_ops.rms_norm's PyTorch form."""
    summed = x if residual is None else x + residual
    wide = summed.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), summed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add-norm", "norm"])
def test_add_and_norm_in_one_launch_equal_pytorchs_ops(dtype, with_residual,
                                                       triton_layer_ops):
    torch.manual_seed(0)
    x = torch.randn(5, 48).to(dtype)  # 48: a row padded to 64 lanes
    residual = torch.randn(5, 48).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(48)).to(dtype)
    out, summed = triton_layer_ops.rms_norm(x, weight, 1e-5, residual)
    want_out, want_summed = _pytorch_norm(x, weight, 1e-5, residual)
    assert out.dtype == dtype and torch.equal(summed, want_summed)
    # the sum of squares in another order: an ulp of the output at most
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, want_out, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add-norm", "norm"])
def test_gemmas_norm_scales_in_float32_in_one_launch(dtype, with_residual, triton_layer_ops):
    """Gemma's norm (a float32 weight, scaled before rounding): the PyTorch form GemmaRMSNorm
    ran, where its bf16 rows converted to float32 and back in every norm of every step."""
    torch.manual_seed(2)
    x = torch.randn(5, 48).to(dtype)
    residual = torch.randn(5, 48).to(dtype) if with_residual else None
    weight = 1 + 0.5 * torch.randn(48)  # float32, 1 + the checkpoint's weight
    out, summed = triton_layer_ops.rms_norm(x, weight, 1e-6, residual, scale_wide=True)
    summed_want = x if residual is None else x + residual
    wide = summed_want.float()
    want = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(dtype)
    assert out.dtype == dtype and torch.equal(summed, summed_want)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, want, **tolerance)
    # where no Triton runs: the PyTorch form (float16), or the C call (float32 rounds nothing)
    torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-6, residual,
                                                  scale_wide=True)[0], want, **tolerance)
    # a weight in the rows' dtype is Llama's norm: not taken as Gemma's
    assert triton_layer_ops.rms_norm(x, weight.to(dtype), 1e-6, residual,
                                     scale_wide=True) is None or dtype == torch.float32


def _rotary_case(head_dim: int, dtype: torch.dtype):
    torch.manual_seed(1)
    tokens = 5
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim).to(dtype)
    # a value row whose quantized values fall on halves: 254 -> scale 2, then 1, 3, 5 -> 0.5 ...
    qkv[0, -head_dim:] = torch.tensor([254.0] + [2.0 * i + 1 for i in range(head_dim - 1)])
    angles = torch.rand(tokens, 1, head_dim // 2).repeat(1, 1, 2) * 6
    cos = angles.cos().to(dtype)
    sin = (angles.sin() * torch.tensor([-1.0, 1.0]).repeat_interleave(head_dim // 2)).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:tokens]
    return qkv, cos, sin, slots // BLOCK_SIZE, slots % BLOCK_SIZE


@pytest.mark.parametrize("head_dim", [16, 12], ids=["d16", "d12-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_rotary_and_one_kv_write_equal_pytorchs(head_dim, dtype, triton_layer_ops):
    qkv, cos, sin, blocks, offsets = _rotary_case(head_dim, dtype)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, head_dim)
    keys, values = _written(triton_layer_ops, (torch.zeros(shape, dtype=dtype),
                                               torch.zeros(shape, dtype=dtype)))
    qk = triton_layer_ops.rotary_store(qkv, cos, sin, HEADS, KV_HEADS, head_dim, keys, values,
                                       blocks, offsets)
    split = (HEADS + KV_HEADS) * head_dim
    want = apply_rotary(qkv[:, :split].view(-1, HEADS + KV_HEADS, head_dim),
                        RotaryAngles(cos, sin))
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(qk, want, **tolerance)
    want_keys, want_values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    want_keys[blocks, :, offsets] = want[:, HEADS:]
    want_values[blocks, :, offsets] = qkv[:, split:].view(-1, KV_HEADS, head_dim)
    torch.testing.assert_close(keys.cpu(), want_keys, **tolerance)
    assert torch.equal(values.cpu(), want_values)


def test_an_int8_cache_gets_kv_int8s_bytes_and_scales(triton_layer_ops):
    """Quantized in the kernel as kv_int8.store_rows quantizes: the same int8 values (halves
    rounded to even) and scales, bit for bit."""
    head_dim = 16
    qkv, cos, sin, blocks, offsets = _rotary_case(head_dim, torch.float32)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, head_dim)
    cache = _written(triton_layer_ops, (torch.zeros(shape, dtype=torch.int8),
                                        torch.zeros(shape, dtype=torch.int8),
                                        torch.zeros(shape[:3]), torch.zeros(shape[:3])))
    qk = triton_layer_ops.rotary_store(qkv, cos, sin, HEADS, KV_HEADS, head_dim, cache[0],
                                       cache[1], blocks, offsets, key_scale=cache[2],
                                       value_scale=cache[3])
    want = [torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
            torch.zeros(shape[:3]), torch.zeros(shape[:3])]
    split = (HEADS + KV_HEADS) * head_dim
    kv_int8.store_rows(want[0], want[2], qk[:, HEADS:], blocks, offsets)
    kv_int8.store_rows(want[1], want[3], qkv[:, split:].view(-1, KV_HEADS, head_dim), blocks,
                       offsets)
    tie_row = want[1][blocks[0], KV_HEADS - 1, offsets[0]]  # 254, 1, 3, 5: 127, 0.5, 1.5, 2.5
    assert tie_row[:4].tolist() == [127, 0, 2, 2]  # halves rounded to even
    for ours, theirs in zip(cache, want):
        assert torch.equal(ours.cpu(), theirs)


def _written(kernels, tensors):
    """The caches a kernel writes in place, on its device (the wrapper moves only copies)."""
    return tuple(t.to(kernels.device) for t in tensors)


@pytest.mark.parametrize("kv_int8_on", [False, True], ids=["f32-cache", "int8-cache"])
def test_a_model_through_the_triton_ops_answers_as_through_pytorchs(tiny_llama, kv_int8_on,
                                                                   triton_layer_ops, monkeypatch):
    """Every norm and rotary cache write of a tiny Llama's prefill and decode steps through the
    Triton ops (as on CUDA, here on CPU tensors): the greedy tokens of the CPU's forms. On a GPU
    the launcher's tests serve through them instead (the wrapper here would write copies)."""
    if triton_layer_ops.device != "cpu":
        pytest.skip("interpreted only: CUDA tensors reach these ops through the served model")
    prompts = [[5, 9, 200, 31, 7, 12], [40, 41, 42]]

    def greedy():
        pool = BlockPool(64)
        engine = make_engine(tiny_llama, num_blocks=64, kv_int8=kv_int8_on)
        return run_to_completion(engine, [request(i, ids, pool.take(len(ids) + 6, 4),
                                                  max_new_tokens=6, ignore_eos=True)
                                          for i, ids in enumerate(prompts)])

    reference = greedy()  # the C ops where they build, else PyTorch's forms
    calls = []

    def on_cuda(tensor):
        calls.append(tensor.shape)
        return triton_layer_ops

    monkeypatch.setattr(layer_ops, "_on_cuda", on_cuda)
    assert greedy() == reference
    assert len(calls) > 2 * 3 * 6  # the norms and cache writes of every layer and step


def test_cuda_tensors_take_the_triton_ops_unless_fused_ops_are_off(monkeypatch):
    pytest.importorskip("triton")
    layer_ops.triton_ops.cache_clear()
    try:
        assert layer_ops.triton_ops().__name__ == "shard.kernels.triton_layer_ops"
        assert layer_ops._on_cuda(torch.zeros(2)) is None  # the CPU keeps its C ops
        monkeypatch.setenv(layer_ops.ENABLED_ENV, "0")
        layer_ops.triton_ops.cache_clear()
        assert layer_ops.triton_ops() is None
    finally:
        layer_ops.triton_ops.cache_clear()
