"""Every attention path takes a float32 or bf16 query over a float32 or bf16 cache, on either kind of CPU.

The CPU's bf16 capability is forced both ways (the `bf16_kernels` fixture), so the branch an AVX-512
BF16 CPU takes runs on an AVX2 one too. Outputs are checked against float64 attention over the
values each path actually sees: the query as given, cached context as the cache rounded it.
"""
import pytest
import torch

from shard.kernels import paged_attention as paged_kernel
from shard.layers.attention import paged_attention, store_kv
from shard.layers.attention_state import (AttentionMetadata, DecodeGroup, LayerCache, PrefillLayout,
                                          gather_index)
from shard.layers.precision import attention_dtype

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 16
SCALE = 0.25
F32, BF16 = torch.float32, torch.bfloat16
# two sequences, blocks out of order: what the router hands over
TABLES = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 4]])


def _cache(dtype: torch.dtype) -> LayerCache:
    torch.manual_seed(1)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return LayerCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))


def _context(cache: LayerCache, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `row`'s first `length` cached keys and values as float64, [length, kv_heads, d]."""
    blocks = TABLES[row, :-(-length // BLOCK_SIZE)]
    # [blocks, kv_heads, block_size, d] -> [tokens, kv_heads, d]
    return tuple(part[blocks].transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)[:length].double()
                 for part in (cache.key, cache.value))


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [n, heads, d] at the last n of keys' positions, causal; float64 -> [n, heads * d]."""
    n, length = q.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * SCALE
    visible = torch.arange(length) <= torch.arange(length - n, length).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values).reshape(n, HEADS * HEAD_DIM)


def _decode(path: str, q, k, v, cache: LayerCache, lens: torch.Tensor) -> torch.Tensor:
    """One new token per sequence at position lens - 1, through the C kernel or the grouped path."""
    positions = lens - 1
    meta = AttentionMetadata(slot_blocks=TABLES.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0],
                             slot_offsets=positions % BLOCK_SIZE, block_tables=TABLES)
    if path == "c-kernel":
        meta.decode_tables, meta.decode_context_lens = TABLES, lens
    else:
        longest = int(lens.max())
        index = gather_index(TABLES, longest, cache.key.shape)
        mask = torch.arange(index.shape[2] * BLOCK_SIZE).unsqueeze(0) < lens.unsqueeze(1)
        meta.decode_groups = [DecodeGroup(None, index, mask)]
    store_kv(k, v, cache, meta)
    return paged_attention(q, k, v, cache, meta, SCALE)


def _prefill(q, k, v, cache: LayerCache, cached: int) -> torch.Tensor:
    """All of q's tokens for sequence 0, after `cached` tokens already in the cache."""
    positions = torch.arange(cached, cached + q.shape[0])
    meta = AttentionMetadata(slot_blocks=TABLES[0, positions // BLOCK_SIZE],
                             slot_offsets=positions % BLOCK_SIZE, block_tables=TABLES[:1],
                             prefill=PrefillLayout(query_starts=[0, q.shape[0]],
                                                   cached_lens=[cached]))
    store_kv(k, v, cache, meta)
    return paged_attention(q, k, v, cache, meta, SCALE)


def _tolerance(query: torch.dtype, keys: torch.dtype, bf16_kernels: bool) -> dict:
    """How far from float64 a query of dtype `query` over keys and values of dtype `keys` may land."""
    if query == keys == BF16 and bf16_kernels:
        return dict(rtol=1 / 64, atol=1e-2)  # bf16 products and probabilities
    if query == BF16:
        # float32 arithmetic, then one rounding to bf16 (half an ulp: 2^-9): bf16 arithmetic
        # anywhere, such as a float32 cache narrowed to the query, lands outside
        return dict(rtol=1 / 256, atol=1e-5)
    return dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [F32, BF16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("query_dtype", [F32, BF16], ids=["f32-query", "bf16-query"])
@pytest.mark.parametrize("path", ["c-kernel", "grouped"])
def test_decode_mixes_query_and_cache_dtypes(path, query_dtype, cache_dtype, bf16_kernels):
    if path == "c-kernel" and paged_kernel.load_kernel() is None:
        pytest.skip("no C compiler here: the shard keeps the PyTorch path")
    cache = _cache(cache_dtype)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, n, HEAD_DIM).to(query_dtype) for n in (HEADS, KV_HEADS, KV_HEADS))
    lens = torch.tensor([6, 13])
    out = _decode(path, q, k, v, cache, lens)
    assert out.dtype == query_dtype and out.shape == (2, HEADS * HEAD_DIM)
    for row, length in enumerate(lens.tolist()):
        keys, values = _context(cache, row, length)  # holds this step's k/v, rounded by the cache
        assert torch.equal(keys[-1], k[row].to(cache_dtype).double())
        torch.testing.assert_close(out[row:row + 1].double(),
                                   _reference(q[row:row + 1], keys, values),
                                   **_tolerance(query_dtype, cache_dtype, bf16_kernels))


@pytest.mark.parametrize("cache_dtype", [F32, BF16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("query_dtype", [F32, BF16], ids=["f32-query", "bf16-query"])
@pytest.mark.parametrize("cached", [0, 5], ids=["fresh-prompt", "continued-prompt"])
def test_prefill_mixes_query_and_cache_dtypes(cached, query_dtype, cache_dtype, bf16_kernels):
    cache = _cache(cache_dtype)
    torch.manual_seed(3)
    # the new tokens' keys and values come from the same projection as the queries: their dtype
    q, k, v = (torch.randn(6, n, HEAD_DIM).to(query_dtype) for n in (HEADS, KV_HEADS, KV_HEADS))
    out = _prefill(q, k, v, cache, cached)
    assert out.dtype == query_dtype and out.shape == (6, HEADS * HEAD_DIM)
    if cached:  # the prefix comes from the cache, the new tokens as the cache stored them
        keys, values = _context(cache, 0, cached + 6)
        keys_dtype = cache_dtype
    else:  # a fresh prompt attends over its own keys and values, not the cache's copy
        keys, values = k.double(), v.double()
        keys_dtype = query_dtype
    torch.testing.assert_close(out.double(), _reference(q, keys, values),
                               **_tolerance(query_dtype, keys_dtype, bf16_kernels))


def test_attention_computes_in_the_wider_dtype_and_widens_bf16_only_without_bf16_kernels(
        bf16_kernels):
    cpu = torch.device("cpu")
    assert attention_dtype(F32, BF16, cpu) == F32  # widening bf16 is exact; narrowing rounds
    assert attention_dtype(BF16, F32, cpu) == F32
    assert attention_dtype(F32, F32, cpu) == F32
    assert attention_dtype(BF16, BF16, cpu) == (BF16 if bf16_kernels else F32)


def test_float16_decode_scores_are_scaled_before_they_can_overflow():
    """Products of float16 queries and keys land in float16: 80 * 80 * 16 = 102,400 passes its
    65,504 and becomes infinite, while the scaled score (25,600) is in range. Scaled first, as
    attention kernels do, the scores stay finite wherever the scaled ones are."""
    cache = _cache(torch.float16)
    lens = torch.tensor([5, 9])
    q = torch.full((2, HEADS, HEAD_DIM), 80.0, dtype=torch.float16)
    k = torch.full((2, KV_HEADS, HEAD_DIM), 80.0, dtype=torch.float16)
    v = torch.randn(2, KV_HEADS, HEAD_DIM).to(torch.float16)
    out = _decode("grouped", q, k, v, cache, lens)
    assert torch.isfinite(out).all()
    for row, length in enumerate(lens.tolist()):
        keys, values = _context(cache, row, length)
        want = _reference(q[row:row + 1], keys, values)
        torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-2, atol=1e-2)


def test_a_continued_prompt_on_cuda_attends_with_its_heads_expanded_to_the_queries():
    """On CUDA the lower-right causal mask goes to kernels that need as many key/value heads as
    query heads: the expanded heads give what grouped-query attention over the same mask gives."""
    from torch.nn.attention.bias import causal_lower_right

    from shard.layers.attention import expand_kv_heads

    torch.manual_seed(4)
    q = torch.randn(1, HEADS, 5, HEAD_DIM, dtype=torch.float64)
    keys, values = (torch.randn(1, KV_HEADS, 12, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    wide_keys, wide_values = expand_kv_heads(keys, values, HEADS)
    assert wide_keys.shape == (1, HEADS, 12, HEAD_DIM)
    mask = causal_lower_right(5, 12)
    got = torch.nn.functional.scaled_dot_product_attention(q, wide_keys, wide_values,
                                                           attn_mask=mask, scale=SCALE)
    want = _reference(q[0].transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1))
    torch.testing.assert_close(got[0].transpose(0, 1).reshape(5, -1), want)
    grouped = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                               scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(got, grouped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, BF16, F32], ids=["f16", "bf16", "f32"])
def test_a_continued_prompt_on_cuda_matches_float64_attention(dtype):
    """The lower-right causal mask through CUDA's kernels (flash in 16 bits, memory-efficient in
    float32) over a context read from the paged cache."""
    global TABLES
    saved, TABLES = TABLES, TABLES.cuda()
    try:
        cache = _cache(dtype)
        cache = LayerCache(cache.key.cuda(), cache.value.cuda())
        torch.manual_seed(5)
        q, k, v = (torch.randn(6, n, HEAD_DIM).to(dtype).cuda()
                   for n in (HEADS, KV_HEADS, KV_HEADS))
        out = _prefill(q, k, v, cache, cached=7)
        TABLES = saved
        keys, values = _context(LayerCache(cache.key.cpu(), cache.value.cpu()), 0, 13)
        tolerance = dict(rtol=1e-2, atol=1e-2) if dtype != F32 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.cpu().double(), _reference(q.cpu(), keys, values),
                                   **tolerance)
    finally:
        TABLES = saved
