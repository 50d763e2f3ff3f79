"""The Triton decode-attention kernel against float64 (interpreted on CPUs, compiled on GPUs).

TRITON_INTERPRET=1 runs the kernel's code on CPU tensors, with the same masks, loop bounds and
online softmax the GPU compiles; only the speed and the products' rounding on the card differ.
Small shapes keep the interpreter fast.
"""
import pytest
import torch

from shard.layers import kv_int8

BLOCK_SIZE, NUM_BLOCKS, SCALE = 4, 40, 0.5
# one token, a full block, a block and one, several blocks
LENGTHS = [1, 4, 5, 23]


def _case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A cache of `dtype` (noise where no sequence wrote), scattered tables, and the queries."""
    torch.manual_seed(seed)
    shape = (NUM_BLOCKS, kv_heads, BLOCK_SIZE, head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    order = torch.randperm(NUM_BLOCKS - 1) + 1
    tables = torch.zeros(len(LENGTHS), 8, dtype=torch.long)  # padded with block 0
    used = 0
    for row, length in enumerate(LENGTHS):
        count = -(-length // BLOCK_SIZE)
        tables[row, :count] = order[used:used + count]
        used += count
    # a slice of a fused projection, as the model hands the queries over: rows not contiguous
    q = torch.randn(len(LENGTHS), heads + kv_heads, head_dim)[:, :heads].to(
        torch.float32 if dtype == torch.int8 else dtype)
    return q, keys, values, tables, torch.tensor(LENGTHS)


def _reference(q, keys, values, tables, lens, window, softcap):
    """Dense float64 attention of each row over its context, read back through its table."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    out = []
    for row, length in enumerate(lens.tolist()):
        positions = torch.arange(length)
        blocks = tables[row, positions // BLOCK_SIZE]
        k = keys[blocks, :, positions % BLOCK_SIZE].double().repeat_interleave(heads // kv_heads, 1)
        v = values[blocks, :, positions % BLOCK_SIZE].double().repeat_interleave(heads // kv_heads,
                                                                                 1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * SCALE
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if window is not None:
            scores[:, positions <= length - 1 - window] = float("-inf")
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 16), (7, 1, 12)],
                         ids=["mha", "gqa", "mqa-odd-dim"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 1.5), (6, 1.5)],
                         ids=["plain", "window", "softcap", "window-softcap"])
def test_float32_cache_matches_float64(heads, kv_heads, head_dim, window, softcap,
                                       triton_kernel):
    q, keys, values, tables, lens = _case(heads, kv_heads, head_dim, torch.float32)
    out = triton_kernel.paged_decode_attention(q, keys, values, tables, lens, SCALE,
                                                  window=window, softcap=softcap)
    assert out.shape == (len(LENGTHS), heads * head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(),
                               _reference(q, keys, values, tables, lens, window, softcap),
                               rtol=1e-5, atol=1e-5)


def test_half_precision_queries_and_cache_match_float64_within_their_rounding(triton_kernel):
    """Half-precision products and float32 sums: within a few ulps of the exact result.

    float16 stands for bf16 here: the kernel's code is the same for both, but the interpreter
    keeps bf16 as raw 16-bit integers, which its tl.dot would multiply as integers."""
    q, keys, values, tables, lens = _case(6, 2, 16, torch.float16)
    keys, values = keys.half(), values.half()
    out = triton_kernel.paged_decode_attention(q, keys, values, tables, lens, SCALE,
                                                  window=5, softcap=2.0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _reference(q, keys, values, tables, lens, 5, 2.0),
                               rtol=5e-3, atol=5e-3)


def test_float32_queries_over_a_bf16_cache_widen_it_exactly(triton_kernel):
    q, keys, values, tables, lens = _case(6, 2, 16, torch.float32)
    keys, values = keys.bfloat16(), values.bfloat16()
    out = triton_kernel.paged_decode_attention(q, keys, values, tables, lens, SCALE, window=5)
    torch.testing.assert_close(out.double(), _reference(q, keys, values, tables, lens, 5, None),
                               rtol=1e-5, atol=1e-5)


def test_int8_cache_matches_float64_over_its_dequantized_rows(triton_kernel):
    """The kernel applies each row's key and value scale as kv_int8 defines them."""
    q, keys, values, tables, lens = _case(6, 2, 16, torch.int8)
    key_q, key_scale = kv_int8.quantize_rows(keys)
    value_q, value_scale = kv_int8.quantize_rows(values)
    out = triton_kernel.paged_decode_attention(q, key_q, value_q, tables, lens, SCALE,
                                                  window=6, softcap=1.5, key_scales=key_scale,
                                                  value_scales=value_scale)
    expected = _reference(q, kv_int8.dequantize_rows(key_q, key_scale),
                          kv_int8.dequantize_rows(value_q, value_scale), tables, lens, 6, 1.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_before_the_kernel_runs(triton_kernel):
    q, keys, values, tables, lens = _case(6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        triton_kernel.paged_decode_attention(q, keys, values.bfloat16(), tables, lens, SCALE)
    with pytest.raises(ValueError, match="scales"):
        triton_kernel.paged_decode_attention(q, keys.to(torch.int8), values.to(torch.int8),
                                                tables, lens, SCALE)
    with pytest.raises(ValueError, match="cannot share"):
        triton_kernel.paged_decode_attention(q[:, :5], keys, values, tables, lens, SCALE)


@pytest.mark.parametrize("splits", [2, 3, 7], ids=lambda s: f"{s}-splits")
@pytest.mark.parametrize("window,softcap", [(None, None), (6, 1.5)], ids=["plain", "window-softcap"])
def test_split_rows_combine_to_float64(splits, window, softcap, triton_kernel):
    """Each row's blocks shared among programs (7: more than any row's 6 blocks, so some are
    empty), their partial softmaxes combined by the second kernel."""
    q, keys, values, tables, lens = _case(6, 2, 16, torch.float32, seed=1)
    out = triton_kernel.paged_decode_attention(q, keys, values, tables, lens, SCALE,
                                                  window=window, softcap=softcap, splits=splits)
    torch.testing.assert_close(out.double(),
                               _reference(q, keys, values, tables, lens, window, softcap),
                               rtol=1e-5, atol=1e-5)


def test_split_int8_and_half_rows_match_float64(triton_kernel):
    q, keys, values, tables, lens = _case(7, 1, 12, torch.int8, seed=2)
    key_q, key_scale = kv_int8.quantize_rows(keys)
    value_q, value_scale = kv_int8.quantize_rows(values)
    out = triton_kernel.paged_decode_attention(q, key_q, value_q, tables, lens, SCALE, window=9,
                                                  key_scales=key_scale, value_scales=value_scale,
                                                  splits=4)
    expected = _reference(q, kv_int8.dequantize_rows(key_q, key_scale),
                          kv_int8.dequantize_rows(value_q, value_scale), tables, lens, 9, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    q, keys, values, tables, lens = _case(6, 2, 16, torch.float16, seed=3)
    out = triton_kernel.paged_decode_attention(q, keys.half(), values.half(), tables, lens, SCALE,
                                                  softcap=2.0, splits=3)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _reference(q, keys.half(), values.half(), tables,
                                                        lens, None, 2.0), rtol=5e-3, atol=5e-3)
