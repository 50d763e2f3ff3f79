"""The int8 KV cache (--kv-cache-dtype int8): quantization bounds, the C writes and attention kernel over
it against float64, the PyTorch paths, the pool's size, and an engine against one with the model's
dtype in its cache."""
import platform

import pytest
import torch

from shard.kernels import layer_ops, paged_attention
from shard.kv_budget import KVCacheSpec, allocate_kv_cache, budget_blocks
from shard.layers import kv_int8
from shard.layers.attention import _attend_group
from shard.layers.attention_state import DecodeGroup, LayerCache, gather_index
from shard.layers.precision import compute_dtype
from shard.layers.rotary import apply_rotary
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion

needs_kernel = pytest.mark.skipif(paged_attention.load_kernel() is None,
                                  reason="no C compiler here: the shard keeps the PyTorch path")


def test_round_trip_is_within_half_a_step_of_each_rows_scale():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    x[0, 0] = 0.0  # a zero row: scale 0, zeros back
    x[1, 1, 5] = -1000.0  # an outlier sets its row's step
    q, scale = kv_int8.quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    back = kv_int8.dequantize_rows(q, scale)
    assert torch.equal(back[0, 0], torch.zeros(64))
    # |x - q s| <= s / 2 (rounding), plus float32's error in x / s and q * s
    bound = scale.unsqueeze(-1) * (0.5 + 1e-5)
    assert bool(((back - x).abs() <= bound).all())
    # the average error of uniform rounding: s / 4 of a row, far below the bound
    relative = ((back - x).abs() / scale.clamp_min(1e-12).unsqueeze(-1))[scale > 0]
    assert 0.2 < float(relative.mean()) < 0.3


def test_bf16_rows_quantize_from_their_exact_float32_values():
    x = torch.randn(7, 2, 16).to(torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(kv_int8.quantize_rows(x),
                                                 kv_int8.quantize_rows(x.float())))


def _int8_cache(num_blocks, kv_heads, block_size, head_dim, seed=0):
    """An int8 LayerCache holding random rows, and the float32 values they stand for."""
    torch.manual_seed(seed)
    keys = torch.randn(num_blocks, kv_heads, block_size, head_dim) * 2
    values = torch.randn(num_blocks, kv_heads, block_size, head_dim)
    kq, ks = kv_int8.quantize_rows(keys)
    vq, vs = kv_int8.quantize_rows(values)
    cache = LayerCache(kq, vq, key_scale=ks, value_scale=vs)
    return cache, keys, values


def _scattered(batch_lens, num_blocks, block_size):
    order = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(len(batch_lens), 12, dtype=torch.long)
    used = 0
    for row, length in enumerate(batch_lens):
        count = -(-length // block_size)
        tables[row, :count] = order[used:used + count]
        used += count
    return tables, torch.tensor(batch_lens)


def _float64_attention(q, keys, values, tables, lens, scale, window=None, softcap=None):
    """The reference: each sequence's context read from float64 key/value blocks, head by head."""
    batch, heads, head_dim = q.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        length = int(lens[b])
        blocks = tables[b, :-(-length // block_size)]
        k = keys[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length].double()
        v = values[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length].double()
        first = 0 if window is None else max(0, length - window)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            s = k[kv, first:] @ q[b, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = s.softmax(0) @ v[kv, first:]
    return out.view(batch, heads * head_dim)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (4, 1, 12),
                                                     (8, 2, 32)],
                         ids=["smollm2", "gqa-128", "mqa-odd-dim", "gqa-32"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_kernel_over_int8_matches_float64_attention(heads, kv_heads, head_dim, query_dtype):
    """Against float64 attention over the values the int8 rows stand for: only float32's error
    (the kernel applies each scale to a score and a weight, not to every element); against the
    unquantized values: the quantization's, under a tenth on these unit-scale values (keys of
    absmax about 7 rounded to steps of 0.05, through scores of 0.2 * 128 products)."""
    block_size, num_blocks = 4, 80
    cache, keys, values = _int8_cache(num_blocks, kv_heads, block_size, head_dim)
    tables, lens = _scattered([1, 4, 5, 17, 38], num_blocks, block_size)
    q = torch.randn(5, heads, head_dim).to(query_dtype)
    out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.2,
                                                 key_scales=cache.key_scale,
                                                 value_scales=cache.value_scale)
    assert out.dtype == query_dtype
    stood_for = _float64_attention(q, kv_int8.dequantize_rows(cache.key, cache.key_scale),
                                   kv_int8.dequantize_rows(cache.value, cache.value_scale),
                                   tables, lens, 0.2)
    exact = 1e-5 if query_dtype == torch.float32 else 1 / 128  # a bf16 output's rounding
    torch.testing.assert_close(out.double(), stood_for, rtol=exact, atol=exact)
    unquantized = _float64_attention(q, keys, values, tables, lens, 0.2)
    assert float((out.double() - unquantized).abs().max()) < 0.1


@needs_kernel
def test_kernel_over_int8_takes_a_window_and_a_soft_cap():
    block_size, num_blocks = 4, 80
    cache, _, _ = _int8_cache(num_blocks, 2, block_size, 64, seed=1)
    tables, lens = _scattered([3, 20, 41], num_blocks, block_size)
    q = torch.randn(3, 4, 64) * 3
    out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.125,
                                                 window=9, softcap=5.0,
                                                 key_scales=cache.key_scale,
                                                 value_scales=cache.value_scale)
    expected = _float64_attention(q, kv_int8.dequantize_rows(cache.key, cache.key_scale),
                                  kv_int8.dequantize_rows(cache.value, cache.value_scale),
                                  tables, lens, 0.125, window=9, softcap=5.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-march=x86-64 is an x86 flag; other CPUs build the portable path")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["portable", "avx2"])
def test_the_builds_for_older_cpus_read_int8_too(tmp_path, monkeypatch, march):
    """The loops CPUs without AVX2 (baseline x86-64) and AVX2-only CPUs (x86-64-v3) compile, over
    the same int8 cache. (The AVX-512 loads are built on AVX-512 CPUs and by test_paged_kernel's
    native build there.)"""
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(paged_attention._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    cache, _, _ = _int8_cache(80, 3, 4, 64, seed=2)
    tables, lens = _scattered([1, 9, 38], 80, 4)
    q = torch.randn(3, 9, 64)
    expected = _float64_attention(q, kv_int8.dequantize_rows(cache.key, cache.key_scale),
                                  kv_int8.dequantize_rows(cache.value, cache.value_scale),
                                  tables, lens, 0.3)
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    monkeypatch.setattr(paged_attention, "FLAGS", [(f"-march={march}" if f == "-march=native"
                                                    else f) for f in paged_attention.FLAGS])
    paged_attention.load_kernel.cache_clear()
    try:
        out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.3,
                                                     key_scales=cache.key_scale,
                                                     value_scales=cache.value_scale)
    finally:
        paged_attention.load_kernel.cache_clear()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_pytorchs_decode_path_dequantizes_what_it_gathers():
    """The gather-then-matmul path (no C kernel) over an int8 cache attends over the values its
    rows stand for."""
    cache, _, _ = _int8_cache(40, 2, 4, 16, seed=3)
    tables, lens = _scattered([3, 10, 22], 40, 4)
    q = torch.randn(3, 4, 16)
    index = gather_index(tables, int(lens.max()), cache.key.shape)
    mask = torch.arange(index.shape[2] * 4).unsqueeze(0) < lens.unsqueeze(1)
    out = _attend_group(q, cache, DecodeGroup(None, index, mask), 0.25)
    expected = _float64_attention(q, kv_int8.dequantize_rows(cache.key, cache.key_scale),
                                  kv_int8.dequantize_rows(cache.value, cache.value_scale),
                                  tables, lens, 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rotary_write_stores_what_quantizing_in_pytorch_stores(dtype):
    """layer_ops.rotary_store into an int8 cache writes the int8 rows and scales that
    kv_int8.store_rows writes for the same rotated keys and values (the rotation itself is
    test_fused_ops' subject: equal but for float32's last bits and rare bf16 units)."""
    if layer_ops.load_library() is None:
        pytest.skip("no C compiler here")
    from shard.layers.rotary import RotaryEmbedding
    torch.manual_seed(4)
    heads, kv_heads, d, tokens = 4, 2, 16, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    angles = RotaryEmbedding(d, 512, 10000.0, None, dtype, torch.device("cpu"))(
        torch.randint(0, 512, (tokens,)))
    cos, sin = angles.cos, angles.sin
    blocks, offsets = torch.tensor([3, 3, 5, 1, 7, 7]), torch.tensor([0, 1, 2, 3, 0, 3])
    spec = KVCacheSpec(1, kv_heads, d, 4, dtype, torch.device("cpu"), int8=True)
    fused, by_hand = allocate_kv_cache(spec, 8)[0], allocate_kv_cache(spec, 8)[0]
    qk = layer_ops.rotary_store(qkv, cos, sin, heads, kv_heads, d, fused.key, fused.value,
                                blocks, offsets, key_scale=fused.key_scale,
                                value_scale=fused.value_scale)
    rotated = apply_rotary(qkv[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d),
                           angles)
    torch.testing.assert_close(qk.float(), rotated.float(), rtol=1 / 128, atol=1e-5)
    kv_int8.store_rows(by_hand.key, by_hand.key_scale, qk[:, heads:], blocks, offsets)
    kv_int8.store_rows(by_hand.value, by_hand.value_scale,
                       qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d), blocks, offsets)
    for name in ("key", "value", "key_scale", "value_scale"):
        assert torch.equal(getattr(fused, name), getattr(by_hand, name)), name
    assert int(fused.key[2].abs().sum()) == 0, "no other block written"


def test_a_pool_of_the_same_bytes_holds_nearly_twice_the_blocks(monkeypatch):
    """SmolLM2's shape (30 layers, 3 kv heads of 64 dims): int8 rows and a float32 scale each take
    68 bytes where bf16 rows take 128, 1.88 times the tokens in the same budget."""
    cpu = torch.device("cpu")
    bf16 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16, cpu)
    int8 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16, cpu, int8=True)
    assert int8.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 4)
    monkeypatch.setattr("shard.kv_budget.available_bytes", lambda device: 8 << 30)
    ratio = (budget_blocks(cpu, 1.0, 1, int8.bytes_per_block)
             / budget_blocks(cpu, 1.0, 1, bf16.bytes_per_block))
    assert ratio == pytest.approx(128 / 68, rel=1e-3)
    cache = allocate_kv_cache(int8, 5)
    assert len(cache) == 30 and cache[0].key.dtype == torch.int8 and cache[0].is_int8
    held = sum(t.numel() * t.element_size() for layer in cache
               for t in (layer.key, layer.value, layer.key_scale, layer.value_scale))
    assert held == 5 * int8.bytes_per_block


PROMPTS = [[5, 17, 99, 3, 42, 8, 150, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
           [200, 201, 202, 30, 31], [9] * 20, [77, 12, 300, 41, 56, 101, 18, 240, 9, 3, 66],
           [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170]]


def _greedy(engine, prompts, new_tokens):
    pool = BlockPool(512)
    requests = [request(i, ids, pool.take(len(ids) + new_tokens, 4), max_new_tokens=new_tokens,
                        ignore_eos=True) for i, ids in enumerate(prompts)]
    return run_to_completion(engine, requests)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_of_an_int8_cache_follow_the_models_dtype(tiny_llama, dtype):
    """Six prompts, 24 tokens each, batched (prefill, then decode steps): in float32 every
    continuation is the same; in bf16 (this random model has near ties: a bf16 KV cache parts
    from float32's on one prompt at its first token) at least four of the six. Measured: float32
    6 of 6; bf16 4 of 6, the others parting at tokens 2 and 15."""
    ours = _greedy(make_engine(tiny_llama, dtype=dtype, kv_int8=True), PROMPTS, 24)
    reference = _greedy(make_engine(tiny_llama, dtype=dtype), PROMPTS, 24)
    same = sum(ours[i] == reference[i] for i in range(len(PROMPTS)))
    assert same >= (6 if dtype == torch.float32 else 4), (ours, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_over_an_int8_cache_are_close(tiny_llama, dtype):
    """Next-token logits of a decode step and of a prompt's second chunk (which attends over the
    first chunk's cached rows through the gather-and-dequantize path), against the model's dtype
    in the cache: within 1% of the largest logit."""
    from shard.model_runner import PrefillSequence
    results = []
    for kv_int8_on in (False, True):
        runner = make_engine(tiny_llama, dtype=dtype, kv_int8=kv_int8_on).runner
        prompt = PROMPTS[4] + PROMPTS[1]
        blocks = list(range(1, 10))
        first = runner.prefill([PrefillSequence(prompt[:11], 0, blocks)])
        second = runner.prefill([PrefillSequence(prompt[11:], 11, blocks)])
        step = runner.decode(torch.tensor([7]), torch.tensor([len(prompt)]),
                             torch.tensor([blocks]))
        results.append((first.last.float(), second.last.float(), step.logits.float()))
    (fresh, chunk, step), (fresh8, chunk8, step8) = results
    largest = float(chunk.abs().max())
    # a fresh prompt attends over its own keys, not the cache: only the order of sums differs (the
    # C kernel's where the float cache's prefill takes it, SDPA's over the int8 cache), which
    # float32 arithmetic keeps to 1e-6 and bf16 arithmetic (AVX-512 BF16 CPUs) rounds to about a
    # bf16 unit (measured 0.6% of the largest logit)
    bf16_math = compute_dtype(dtype, torch.device("cpu")) == torch.bfloat16
    torch.testing.assert_close(fresh8, fresh, rtol=0, atol=0.01 * largest if bf16_math else 1e-6)
    for ours, reference in ((chunk8, chunk), (step8, step)):
        difference = float((ours - reference).abs().max())
        # measured: 0.2% of the largest logit in float32, 0.6% in bf16 (about a bf16 unit)
        assert 0 < difference < 0.01 * largest, (difference, largest)


def test_beams_copy_the_scales_with_the_rows(tiny_llama):
    runner = make_engine(tiny_llama, kv_int8=True).runner
    layer = runner.cache[0]
    layer.key[3].fill_(5)
    layer.key_scale[3].fill_(0.5)
    layer.value_scale[3].fill_(0.25)
    runner.copy_blocks([(3, 9)])
    assert torch.equal(layer.key[9], layer.key[3])
    assert float(layer.key_scale[9].min()) == 0.5 and float(layer.value_scale[9].max()) == 0.25


def test_an_int8_cache_refuses_the_paths_that_do_not_read_it(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="compiled decode step"):
        make_engine(tiny_llama, kv_int8=True, compile_decode=True)
    from shard.kernels import decode_backend
    from shard.model_runner import ModelRunner
    model = make_engine(tiny_llama).runner.model
    spec = KVCacheSpec(3, 2, 16, 4, torch.float16, torch.device("cuda"), int8=True)
    # CUDA without Triton's kernels (here: turned off) would gather and dequantize every step
    monkeypatch.setenv(decode_backend.TRITON_ENV, "0")
    decode_backend.triton_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match="read by Triton's attention kernels"):
            ModelRunner(model, spec)
    finally:
        monkeypatch.undo()
        decode_backend.triton_kernel.cache_clear()
