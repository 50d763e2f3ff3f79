"""The fused layer ops (shard/kernels/layer_ops.c) against the PyTorch ops they stand for."""
import platform

import pytest
import torch

from shard.kernels import layer_ops, native
from shard.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(layer_ops.load_library() is None,
                                reason="no C compiler here: the shard keeps the PyTorch ops")


@pytest.fixture
def pytorch_ops(monkeypatch):
    """Calls a function of shard.kernels.layer_ops with the library switched off: its PyTorch form."""
    def call(fn, *args):
        monkeypatch.setenv(layer_ops.ENABLED_ENV, "0")
        layer_ops.load_library.cache_clear()
        try:
            return fn(*args)
        finally:
            monkeypatch.delenv(layer_ops.ENABLED_ENV)
            layer_ops.load_library.cache_clear()
    return call


def _assert_same(actual, expected, dtype):
    """bf16: every op rounds where PyTorch's rounds, so results are equal but for rare elements one
    bf16 unit apart (a row's sum of squares and the exponential are computed in another order);
    float32: equal to a few units in the last place."""
    if dtype != torch.bfloat16:
        torch.testing.assert_close(actual, expected, rtol=3e-6, atol=1e-6)
        return
    actual, expected = actual.float(), expected.float()
    _, exponent = torch.frexp(expected)
    one_unit = torch.ldexp(torch.ones_like(expected), exponent - 8)  # bf16 keeps 8 bits
    differ = actual != expected
    assert ((actual - expected).abs() <= one_unit)[differ].all(), "a result off by over one unit"
    assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {differ.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300], ids=["one-row", "decode", "prefill-threads"])
def test_rms_norm_with_and_without_the_residual_add(dtype, rows, pytorch_ops):
    torch.manual_seed(0)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    weight = (torch.rand(576) + 0.5).to(dtype)
    normed, summed = layer_ops.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_summed = pytorch_ops(layer_ops.rms_norm, x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    _assert_same(normed, expected_normed, dtype)
    alone, same = layer_ops.rms_norm(x, weight, 1e-6)
    assert same is x
    _assert_same(alone, pytorch_ops(layer_ops.rms_norm, x, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33], ids=["one-row", "threads"])
def test_silu_and_mul(dtype, rows, pytorch_ops):
    torch.manual_seed(0)
    # gates wide enough to reach the exponential's ends (0 below -87.3, infinite above 88.72)
    gate = torch.cat([torch.randn(rows, 1024) * 4, torch.linspace(-120, 120, 512).expand(rows, 512)],
                     dim=1)
    gate_up = torch.cat([gate, torch.randn(rows, 1536)], dim=1).to(dtype)
    out = layer_ops.silu_and_mul(gate_up)
    assert out.shape == (rows, 1536)
    _assert_same(out, pytorch_ops(layer_ops.silu_and_mul, gate_up), dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "float32-over-bf16-cache", "bf16"])
@pytest.mark.parametrize("tokens", [3, 200], ids=["decode", "prefill-threads"])
def test_rotary_store_rotates_and_writes_the_cache_slots(dtype, cache_dtype, tokens):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype, torch.device("cpu"))
    angles = rotary(torch.randint(0, 4096, (tokens,)))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    blocks = torch.randperm(40)[:-(-tokens // block_size)] + 1
    slot_blocks = blocks.repeat_interleave(block_size)[:tokens]
    slot_offsets = torch.arange(tokens) % block_size
    key = torch.zeros(48, kv_heads, block_size, head_dim, dtype=cache_dtype)
    value = torch.zeros_like(key)
    expected_key, expected_value = key.clone(), value.clone()

    qk = layer_ops.rotary_store(qkv, angles.cos, angles.sin, heads, kv_heads, head_dim, key, value,
                            slot_blocks, slot_offsets)

    rotated = apply_rotary(qkv[:, :(heads + kv_heads) * head_dim].view(tokens, -1, head_dim),
                           angles)
    expected_key[slot_blocks, :, slot_offsets] = rotated[:, heads:].to(cache_dtype)
    expected_value[slot_blocks, :, slot_offsets] = qkv[:, (heads + kv_heads) * head_dim:].view(
        tokens, kv_heads, head_dim).to(cache_dtype)
    _assert_same(qk, rotated, dtype)
    _assert_same(key, expected_key, dtype)
    assert torch.equal(value, expected_value)  # a copy (rounded like .to() when narrowed)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[blocks] = False
    assert not key[untouched].any() and not value[untouched].any()


def test_rotary_store_refuses_a_slot_outside_the_cache():
    qkv = torch.randn(2, 3 * 8)
    angles = torch.ones(2, 8), torch.zeros(2, 8)
    for blocks, offsets in [([0, 2], [0, 1]), ([0, 1], [0, 4]), ([-1, 0], [0, 0])]:
        key, value = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
        with pytest.raises(IndexError):
            layer_ops.rotary_store(qkv, *angles, 1, 1, 8, key, value, torch.tensor(blocks),
                               torch.tensor(offsets))
        assert not key.any() and not value.any()
    with pytest.raises(ValueError):  # a projection of another model's width
        layer_ops.rotary_store(torch.randn(2, 4 * 8), *angles, 1, 1, 8, key, value,
                           torch.tensor([0, 1]), torch.tensor([0, 1]))


def test_other_dtypes_and_switched_off_take_the_pytorch_forms(monkeypatch):
    assert layer_ops._fused(torch.randn(2, 8)) is not None
    assert layer_ops._fused(torch.empty(2, 8, device="meta")) is None  # not on the CPU
    assert layer_ops._fused(torch.randn(2, 8), torch.randn(8, 2).t()) is None  # not contiguous
    assert layer_ops._fused(torch.randn(2, 8), torch.randn(2, 8).bfloat16()) is None  # mixed dtypes
    x = torch.randn(4, 64, dtype=torch.float16)
    weight = torch.ones(64, dtype=torch.float16)
    normed, _ = layer_ops.rms_norm(x, weight, 1e-6)
    assert normed.dtype == torch.float16
    cache = torch.zeros(2, 1, 4, 8)
    assert layer_ops.rotary_store(torch.randn(2, 24, dtype=torch.float16),
                              torch.ones(2, 8, dtype=torch.float16),
                              torch.zeros(2, 8, dtype=torch.float16), 1, 1, 8, cache, cache,
                              torch.zeros(2, dtype=torch.long), torch.arange(2)) is None
    monkeypatch.setenv(layer_ops.ENABLED_ENV, "0")
    layer_ops.load_library.cache_clear()
    try:
        assert layer_ops.load_library() is None
        assert layer_ops.rotary_store(torch.randn(2, 24), torch.ones(2, 8), torch.zeros(2, 8), 1, 1,
                                  8, cache, cache, torch.zeros(2, dtype=torch.long),
                                  torch.arange(2)) is None
    finally:
        layer_ops.load_library.cache_clear()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-march=x86-64 is an x86 flag")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["sse2", "avx2"])
def test_the_builds_for_older_cpus_match_pytorch(tmp_path, monkeypatch, march, pytorch_ops):
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(native.cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    monkeypatch.setattr(layer_ops, "FLAGS", [(f"-march={march}" if f == "-march=native" else f)
                                         for f in layer_ops.FLAGS])
    layer_ops.load_library.cache_clear()
    try:
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            x, residual = torch.randn(40, 576).to(dtype), torch.randn(40, 576).to(dtype)
            weight = torch.rand(576).to(dtype)
            _assert_same(layer_ops.rms_norm(x, weight, 1e-5, residual)[0],
                         pytorch_ops(layer_ops.rms_norm, x, weight, 1e-5, residual)[0], dtype)
            gate_up = (torch.randn(40, 512) * 4).to(dtype)
            _assert_same(layer_ops.silu_and_mul(gate_up), pytorch_ops(layer_ops.silu_and_mul, gate_up),
                         dtype)
        scores = torch.randn(8, 49152) * 5
        ids, logprobs = layer_ops.greedy_pick(scores)
        assert torch.equal(ids, scores.argmax(dim=-1))
        torch.testing.assert_close(logprobs.double(), torch.log_softmax(scores.double(), -1).gather(
            1, ids.unsqueeze(1)).squeeze(1), rtol=0, atol=1e-6)
        assert layer_ops.load_library() is not None
        assert list((tmp_path / "kernels").glob("layer_ops-*.so"))
    finally:
        layer_ops.load_library.cache_clear()


def test_greedy_pick_is_argmax_and_its_log_softmax():
    torch.manual_seed(0)
    scores = torch.randn(33, 49152) * 5
    scores[3, 100] = scores[3, 7] = scores[3].max() + 1  # a tie: the first maximum, as argmax
    scores[5, 20:] = float("-inf")  # most of a row masked off, as a grammar masks
    ids, logprobs = layer_ops.greedy_pick(scores)
    assert torch.equal(ids, scores.argmax(dim=-1))
    assert ids[3] == 7
    # against float64: PyTorch's float32 log_softmax is itself ~6e-6 off on 49152 tokens
    expected = torch.log_softmax(scores.double(), dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-6)
    one_id, one_logprob = layer_ops.greedy_pick(scores[:1].contiguous())
    assert one_id.tolist() == ids[:1].tolist()
    torch.testing.assert_close(one_logprob, logprobs[:1])
    assert layer_ops.greedy_pick(scores.bfloat16()) is None  # float32 scores only
