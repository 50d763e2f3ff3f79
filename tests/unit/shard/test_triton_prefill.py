"""The Triton prefill-attention kernel against float64 (interpreted on CPUs, compiled on GPUs).

New tokens over their cached prefix, read in place through each sequence's block table. Small
shapes keep the interpreter fast; float16 stands for bf16 (see test_triton_attention).
"""
import pytest
import torch

from shard.layers import kv_int8

BLOCK_SIZE, NUM_BLOCKS, SCALE = 4, 48, 0.5
# (cached, new) per sequence: a fresh prompt, one token after a full block, a chunk after a
# block and one, a long chunk over a longer prefix, one skipped by the kernel
SEQUENCES = [(0, 5), (4, 1), (5, 9), (17, 14), (3, 2)]
ROUTED = [0, 1, 2, 3]


def _case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A cache of `dtype` (noise where no sequence wrote), scattered tables, flat queries."""
    torch.manual_seed(seed)
    shape = (NUM_BLOCKS, kv_heads, BLOCK_SIZE, head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    order = torch.randperm(NUM_BLOCKS - 1) + 1
    tables = torch.zeros(len(SEQUENCES), 9, dtype=torch.long)  # padded with block 0
    used = 0
    for row, (cached, new) in enumerate(SEQUENCES):
        count = -(-(cached + new) // BLOCK_SIZE)
        tables[row, :count] = order[used:used + count]
        used += count
    starts = [0]
    for _, new in SEQUENCES:
        starts.append(starts[-1] + new)
    # a slice of a fused projection, as the model hands the queries over: rows not contiguous
    q = torch.randn(starts[-1], heads + kv_heads, head_dim)[:, :heads].to(
        torch.float32 if dtype == torch.int8 else dtype)
    return q, keys, values, tables, starts


def _reference(q, keys, values, tables, starts, window, softcap):
    """Dense float64 causal attention of each routed sequence's new tokens over its context."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    out = torch.zeros(q.shape[0], heads * q.shape[2], dtype=torch.float64)
    for b in ROUTED:
        cached, new = SEQUENCES[b]
        positions = torch.arange(cached + new)
        blocks = tables[b, positions // BLOCK_SIZE]
        k = keys[blocks, :, positions % BLOCK_SIZE].double().repeat_interleave(heads // kv_heads, 1)
        v = values[blocks, :, positions % BLOCK_SIZE].double().repeat_interleave(heads // kv_heads,
                                                                                 1)
        for i in range(new):
            row, at = starts[b] + i, cached + i
            scores = torch.einsum("hd,lhd->hl", q[row].double(), k[:at + 1]) * SCALE
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if window is not None:
                scores[:, positions[:at + 1] <= at - window] = float("-inf")
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:at + 1]).reshape(-1)
    return out


def _routed_rows(starts):
    return torch.cat([torch.arange(starts[b], starts[b + 1]) for b in ROUTED])


def _run(kernel, q, keys, values, tables, starts, **options):
    cached = [c for c, _ in SEQUENCES]
    return kernel.paged_prefill_attention(q, keys, values, tables, starts, cached, ROUTED, SCALE,
                                          **options)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 16), (7, 1, 12)],
                         ids=["mha", "gqa", "mqa-odd-dim"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 1.5), (6, 1.5)],
                         ids=["plain", "window", "softcap", "window-softcap"])
def test_float32_cache_matches_float64(heads, kv_heads, head_dim, window, softcap, triton_prefill,
                                       monkeypatch):
    # 16 rows a program: several tiles a sequence, each a few tokens of every head in a group
    monkeypatch.setattr(triton_prefill.module, "TILE_ROWS", 16)
    q, keys, values, tables, starts = _case(heads, kv_heads, head_dim, torch.float32)
    out = _run(triton_prefill, q, keys, values, tables, starts, window=window, softcap=softcap)
    assert out.shape == (q.shape[0], heads * head_dim) and out.dtype == torch.float32
    rows = _routed_rows(starts)
    want = _reference(q, keys, values, tables, starts, window, softcap)
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-5, atol=1e-5)


def test_half_precision_within_its_rounding_and_int8_over_its_dequantized_rows(triton_prefill):
    q, keys, values, tables, starts = _case(6, 2, 16, torch.float16, seed=1)
    rows = _routed_rows(starts)
    out = _run(triton_prefill, q, keys.half(), values.half(), tables, starts, window=5,
               softcap=2.0)
    assert out.dtype == torch.float16
    want = _reference(q, keys.half(), values.half(), tables, starts, 5, 2.0)
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=5e-3, atol=5e-3)
    q, keys, values, tables, starts = _case(6, 2, 16, torch.int8, seed=2)
    key_q, key_scale = kv_int8.quantize_rows(keys)
    value_q, value_scale = kv_int8.quantize_rows(values)
    out = _run(triton_prefill, q, key_q, value_q, tables, starts, window=7, key_scales=key_scale,
               value_scales=value_scale)
    want = _reference(q, kv_int8.dequantize_rows(key_q, key_scale),
                      kv_int8.dequantize_rows(value_q, value_scale), tables, starts, 7, None)
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-5, atol=1e-5)


def test_bad_caches_are_refused_before_the_kernel_runs(triton_prefill):
    q, keys, values, tables, starts = _case(6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        _run(triton_prefill, q, keys, values.bfloat16(), tables, starts)
    with pytest.raises(ValueError, match="cannot share"):
        _run(triton_prefill, q[:, :5], keys, values, tables, starts)


def test_a_forwards_layers_share_one_upload_of_the_tiles(triton_prefill):
    q, keys, values, tables, starts = _case(6, 2, 16, torch.float32, seed=3)
    memo = {}
    first = _run(triton_prefill, q, keys, values, tables, starts, memo=memo)
    uploaded = dict(memo)
    again = _run(triton_prefill, q, keys, values, tables, starts, memo=memo)
    assert len(memo) == 1 and all(memo[k][0] is uploaded[k][0] for k in memo)
    rows = _routed_rows(starts)
    assert torch.equal(first[rows], again[rows])
