"""The C decode-attention kernel against PyTorch's gather-then-matmul path on the same paged cache."""
import platform

import pytest
import torch

from shard.kernels import paged_attention
from shard.layers.attention import _attend_group
from shard.layers.attention_state import DecodeGroup, LayerCache, gather_index

pytestmark = pytest.mark.skipif(paged_attention.load_kernel() is None,
                                reason="no C compiler here: the shard keeps the PyTorch path")


def _torch_reference(q, cache, tables, lens, scale):
    longest = int(lens.max())
    index = gather_index(tables, longest, cache.key.shape)
    block_size = cache.key.shape[2]
    mask = torch.arange(index.shape[2] * block_size).unsqueeze(0) < lens.unsqueeze(1)
    return _attend_group(q.float(), cache, DecodeGroup(None, index, mask), scale)


def _scattered_case(dtype, heads, kv_heads, head_dim):
    """A cache of `dtype`, five sequences' block tables and context lengths, and their queries."""
    torch.manual_seed(0)
    block_size, batch, num_blocks = 4, 5, 64
    cache = LayerCache(torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype),
                       torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype))
    lens = torch.tensor([1, 4, 5, 17, 38])  # one token, a full block, a block and one, longer
    # each row's blocks scattered over the pool, padded with block 0 as the router pads
    order = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(batch, 10, dtype=torch.long)
    used = 0
    for row, length in enumerate(lens.tolist()):
        count = -(-length // block_size)
        tables[row, :count] = order[used:used + count]
        used += count
    # queries as the model hands them over: a slice of the fused projection, rows not contiguous
    q = torch.randn(batch, heads + kv_heads, head_dim)[:, :heads]
    return cache, tables, lens, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(4, 4, 64), (9, 3, 64), (4, 2, 128), (8, 2, 128), (7, 1, 64),
                          (10, 2, 32), (4, 2, 24), (4, 1, 12)],
                         ids=["mha", "gqa", "gqa-128", "gqa-4-heads-128", "mqa-7-heads",
                              "gqa-5-heads", "gqa-24", "mqa-odd-dim"])
def test_kernel_matches_pytorch_on_scattered_blocks(dtype, heads, kv_heads, head_dim,
                                                    bf16_kernels):
    """float32 queries over either cache, against the PyTorch path as each kind of CPU runs it."""
    cache, tables, lens, q = _scattered_case(dtype, heads, kv_heads, head_dim)
    out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.3)
    expected = _torch_reference(q, cache, tables, lens, 0.3)
    assert out.shape == (5, heads * head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-march=x86-64 is an x86 flag; other CPUs build the portable path already")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["portable", "avx2"])
def test_the_builds_for_older_cpus_match_pytorch(tmp_path, monkeypatch, march):
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(paged_attention._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    """The loops that CPUs without AVX2 (baseline x86-64) or without AVX-512 (x86-64-v3: AVX2 and
    FMA) compile, built here whatever this CPU has."""
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    monkeypatch.setattr(paged_attention, "FLAGS", [(f"-march={march}" if f == "-march=native" else f)
                                                for f in paged_attention.FLAGS])
    paged_attention.load_kernel.cache_clear()
    try:
        assert paged_attention.load_kernel() is not None
        for dtype in (torch.float32, torch.bfloat16):
            for shape in [(4, 4, 64), (9, 3, 64), (8, 2, 128), (10, 2, 32), (4, 2, 24),
                          (4, 1, 12)]:
                cache, tables, lens, q = _scattered_case(dtype, *shape)
                out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens,
                                                          0.3)
                torch.testing.assert_close(out, _torch_reference(q, cache, tables, lens, 0.3),
                                           rtol=1e-5, atol=1e-5)
    finally:
        paged_attention.load_kernel.cache_clear()


def test_a_single_token_context_returns_its_value():
    value = torch.randn(2, 1, 4, 8)
    cache = LayerCache(torch.randn(2, 1, 4, 8), value)
    q = torch.randn(1, 2, 8)
    out = paged_attention.paged_decode_attention(q, cache.key, cache.value, torch.tensor([[1]]),
                                              torch.tensor([1]), 1.0)
    assert torch.allclose(out.view(2, 8), value[1, 0, 0].expand(2, 8))


def test_bf16_activations_come_back_in_their_dtype(bf16_kernels):
    cache = LayerCache(torch.randn(4, 2, 4, 16, dtype=torch.bfloat16),
                       torch.randn(4, 2, 4, 16, dtype=torch.bfloat16))
    q = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    tables, lens = torch.tensor([[1, 2], [3, 0], [2, 1]]), torch.tensor([6, 3, 8])
    out = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _torch_reference(q, cache, tables, lens, 0.25),
                               rtol=1 / 64, atol=1e-2)


def test_the_kernel_is_built_into_the_cache_once_and_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    paged_attention.load_kernel.cache_clear()
    try:
        assert paged_attention.load_kernel() is not None
        built = list((tmp_path / "kernels").glob("paged_attention-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        paged_attention.load_kernel.cache_clear()
        paged_attention.load_kernel()
        assert built[0].stat().st_mtime_ns == stamp, "a cached build is reused, not rebuilt"
        assert paged_attention.supports(torch.device("cpu"), torch.bfloat16)
        assert not paged_attention.supports(torch.device("cpu"), torch.float16)

        monkeypatch.setenv(paged_attention.ENABLED_ENV, "0")
        paged_attention.load_kernel.cache_clear()
        assert paged_attention.load_kernel() is None
        assert not paged_attention.supports(torch.device("cpu"), torch.float32)
    finally:
        paged_attention.load_kernel.cache_clear()


def test_without_a_c_compiler_the_pytorch_path_stays(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    paged_attention.load_kernel.cache_clear()
    try:
        assert paged_attention.load_kernel() is None
        assert "no C compiler" in caplog.text
        assert not (tmp_path / "kernels").exists()
    finally:
        paged_attention.load_kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_through_the_kernel_match_pytorchs_prefill(dtype, bf16_kernels):
    """A fresh prompt and one continuing 6 cached tokens, each new token a row of the kernel
    reading the cache up to itself, against PyTorch's attention sequence by sequence."""
    from shard.attention_inputs import prefill_metadata as _metadata
    from shard.layers.attention import paged_attention, store_kv

    torch.manual_seed(1)
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 4
    cache = LayerCache(torch.zeros(16, kv_heads, block_size, head_dim, dtype=dtype),
                       torch.zeros(16, kv_heads, block_size, head_dim, dtype=dtype))
    cached = torch.randn(6, kv_heads, head_dim).to(dtype)  # the continued prompt's first tokens
    cache.key[[5, 5, 5, 5, 9, 9], :, [0, 1, 2, 3, 0, 1]] = cached
    cache.value[[5, 5, 5, 5, 9, 9], :, [0, 1, 2, 3, 0, 1]] = cached.flip(0)
    tables = torch.tensor([[1, 2, 3, 0], [5, 9, 4, 7]])
    query_lens, context_lens = [11, 7], [11, 13]
    positions = torch.cat([torch.arange(0, 11), torch.arange(6, 13)])
    q = torch.randn(18, heads, head_dim).to(dtype)
    k, v = torch.randn(18, kv_heads, head_dim).to(dtype), torch.randn(18, kv_heads, head_dim).to(dtype)
    outs = []
    for through_kernel in (False, True):
        meta = _metadata(tables, positions, query_lens, context_lens, block_size)
        if through_kernel:
            meta.prefill.row_tables = tables[torch.tensor([0] * 11 + [1] * 7)]
            meta.prefill.row_context_lens = positions + 1
            meta.prefill.kernel_sequences = [True, True]
        copy = LayerCache(cache.key.clone(), cache.value.clone())
        store_kv(k, v, copy, meta)
        outs.append(paged_attention(q, k, v, copy, meta, 0.125).float())
    tolerance = 1e-5 if dtype == torch.float32 else 1 / 64
    torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)


def test_a_prefill_forward_gives_the_same_logits_whichever_path_each_sequence_takes(
        tiny_llama, monkeypatch):
    """The runner's choice per sequence (the kernel for short contexts, PyTorch for longer ones),
    with a running batch riding in the forward, a fresh prompt scored at every position and a
    chunk continuing cached tokens: logits as when every sequence goes through PyTorch."""
    from shard import attention_inputs
    from shard.model_runner import DecodeRows, PrefillSequence
    from tests.engine_helpers import make_engine

    runner = make_engine(tiny_llama).runner
    kernel_calls = []
    original = paged_attention.paged_decode_attention

    def counting(q, *args, **kwargs):
        kernel_calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_decode_attention", counting)

    def second_forward(limit):
        monkeypatch.setattr(attention_inputs, "PREFILL_KERNEL_MAX_CONTEXT", limit)
        # the running sequence (10 tokens) and the first 6 of a chunked one, into the cache
        runner.prefill([PrefillSequence(list(range(20, 30)), 0, [1, 2, 3]),
                        PrefillSequence(list(range(40, 46)), 0, [10, 11, 12, 13])])
        kernel_calls.clear()
        riding = DecodeRows(torch.tensor([31]), torch.tensor([10]), torch.tensor([[1, 2, 3]]))
        out = runner.prefill([PrefillSequence(list(range(50, 59)), 0, [20, 21, 22]),
                              PrefillSequence(list(range(46, 53)), 6, [10, 11, 12, 13])],
                             all_logits_rows={0}, decode=riding)
        return out, list(kernel_calls)

    want, none = second_forward(0)
    for limit, rows in ((12, 9), (512, 16)):  # the fresh prompt alone (context 9), then both
        got, calls = second_forward(limit)
        layers = runner.model.config.num_hidden_layers
        # per layer: the riding decode row, then the prefill rows that went through the kernel
        assert calls == [1, rows] * layers, calls
        torch.testing.assert_close(got.last, want.last, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.full[0], want.full[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.decode, want.decode, rtol=1e-5, atol=1e-5)
    assert none == [1] * runner.model.config.num_hidden_layers, "only the riding decode row"


def test_bf16_queries_read_and_written_in_place_equal_the_widened_float32_call():
    """bf16 queries are widened inside the kernel and its output rounded there: bit for bit what
    widening the queries first and rounding the float32 output after gives."""
    for cache_dtype in (torch.float32, torch.bfloat16):
        cache, tables, lens, q = _scattered_case(cache_dtype, 9, 3, 64)
        q = q.to(torch.bfloat16)  # a strided view's copy: rows of 9 heads
        in_place = paged_attention.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.3)
        widened = paged_attention.paged_decode_attention(q.float(), cache.key, cache.value, tables,
                                                      lens, 0.3)
        assert in_place.dtype == torch.bfloat16
        assert torch.equal(in_place, widened.to(torch.bfloat16))
        strided = torch.randn(5, 12, 64).to(torch.bfloat16)[:, :9]  # rows 12 heads apart
        assert torch.equal(
            paged_attention.paged_decode_attention(strided, cache.key, cache.value, tables, lens, 0.3),
            paged_attention.paged_decode_attention(strided.float(), cache.key, cache.value, tables,
                                                lens, 0.3).to(torch.bfloat16))
