"""Sliding windows and soft-capped scores in every attention path (prefill fresh or continuing a
cached prefix, through PyTorch or the C kernel; decode through the C kernel, PyTorch's groups or a
CUDA graph's fixed-shape metadata, gathered or read in place by Triton's kernel; decode rows riding
in a prefill), against dense float64 attention over the same queries, keys and values. Without
either, the paths are the ones they were, bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shard import attention_inputs
from shard.attention_inputs import (decode_metadata, prefill_metadata, route_short_contexts,
                                    static_decode_metadata)
from shard.kernels import decode_backend, triton_shapes
from shard.kernels import paged_attention as paged_kernel
from shard.kv_budget import KVCacheSpec
from shard.layers import attention, attention_state
from shard.layers.attention import paged_attention, store_kv
from shard.layers.attention_state import LayerCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64
# scores of a few units: a cap of 1.5 changes most of them
SCALE, CAP = 0.5, 1.5
# (window, softcap): windows of one key, shorter and longer than the contexts, with and without
# the cap (neither: test_without_window_or_cap_the_paths_are_the_plain_ones_bit_for_bit)
CASES = [(None, CAP), (1, None), (3, None), (3, CAP), (8, CAP), (64, None)]
CASE_IDS = ["cap", "window-1", "window-3", "window-3-cap", "window-8-cap", "window-64"]

needs_kernel = pytest.mark.skipif(paged_kernel.load_kernel() is None,
                                  reason="no C compiler here: the shard keeps the PyTorch path")


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               window: int | None, softcap: float | None) -> torch.Tensor:
    """q [n, heads, d] at `positions` over keys and values [L, kv_heads, d] at positions 0 .. L-1:
    causal, each query seeing its last `window` positions, scores capped; float64 ->
    [n, heads * d]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, 1)
    values = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions <= positions.unsqueeze(1)
    if window is not None:
        visible &= key_positions > positions.unsqueeze(1) - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values).reshape(q.shape[0], -1)


def _sequences(lengths: list[int], head_dim: int = HEAD_DIM, seed: int = 0,
               blocks: range = range(1, 32)):
    """Block tables of sequences with these lengths, `blocks` scattered among them (padded with
    block 0), and each one's queries, keys and values at every position."""
    torch.manual_seed(seed)
    order = (torch.randperm(len(blocks)) + blocks.start).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in lengths) + 1
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // BLOCK_SIZE)
        tables[row, :count] = torch.tensor(order[used:used + count])
        used += count
    qkv = [(torch.randn(n, HEADS, head_dim), torch.randn(n, KV_HEADS, head_dim),
            torch.randn(n, KV_HEADS, head_dim)) for n in lengths]
    return tables, qkv


def _cache(head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32) -> LayerCache:
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, head_dim)
    # noise where no sequence wrote: a path reading past a window or a context would show
    return LayerCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))


def _write(cache: LayerCache, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           start: int = 0) -> None:
    """k, v [n, kv_heads, d] into one sequence's slots from position `start`."""
    positions = torch.arange(start, start + k.shape[0])
    cache.key[table[positions // BLOCK_SIZE], :, positions % BLOCK_SIZE] = k.to(cache.key.dtype)
    cache.value[table[positions // BLOCK_SIZE], :, positions % BLOCK_SIZE] = v.to(cache.key.dtype)


def _prefill_case():
    """A fresh 10-token prompt and a 7-token chunk continuing 9 cached tokens: their metadata (not
    yet routed), the new rows' q, k, v, the cache holding the prefix, and each one's full
    context."""
    tables, ((q0, k0, v0), (q1, k1, v1)) = _sequences([10, 16])
    cache = _cache()
    _write(cache, tables[1], k1[:9], v1[:9])
    query_lens, context_lens = [10, 7], [10, 16]
    positions = torch.cat([torch.arange(0, 10), torch.arange(9, 16)])
    meta = prefill_metadata(tables, positions, query_lens, context_lens, BLOCK_SIZE)
    q, k, v = torch.cat([q0, q1[9:]]), torch.cat([k0, k1[9:]]), torch.cat([v0, v1[9:]])
    contexts = [(k0, v0), (k1, v1)]
    return meta, (tables, positions, query_lens, context_lens), (q, k, v), cache, contexts


def _route(meta, inputs, path: str) -> None:
    """Sends the prefill's sequences through the C kernel ("kernel"), only the fresh one there
    ("mixed"), or none ("pytorch")."""
    if path == "pytorch":
        return
    route_short_contexts(meta, *inputs)
    if path == "mixed":
        meta.prefill.kernel_sequences = [True, False]


@pytest.mark.parametrize("path", ["pytorch", pytest.param("kernel", marks=needs_kernel),
                                  pytest.param("mixed", marks=needs_kernel), "triton"])
@pytest.mark.parametrize("window,softcap", CASES, ids=CASE_IDS)
def test_prefill_fresh_and_continued(path, window, softcap, monkeypatch, request):
    """"triton": CUDA's selection, its kernel interpreted on CPU tensors (the continued prompt
    read in place; the fresh one too where capped, else through SDPA)."""
    meta, inputs, (q, k, v), cache, contexts = _prefill_case()
    if path == "triton":
        kernel = request.getfixturevalue("triton_prefill")
        monkeypatch.setattr(decode_backend, "prefill_kernel", lambda device, dtype: kernel)
    else:
        _route(meta, inputs, path)
    store_kv(k, v, cache, meta)
    out = paged_attention(q, k, v, cache, meta, SCALE, window=window, softcap=softcap)
    positions = inputs[1]
    want = torch.cat([_reference(q[:10], *contexts[0], positions[:10], window, softcap),
                      _reference(q[10:], *contexts[1], positions[10:], window, softcap)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(3, None), (5, CAP), (None, CAP)],
                         ids=["window", "window-cap", "cap"])
def test_a_long_continued_prefill_in_slices_of_queries(monkeypatch, window, softcap):
    """A capped prefill computes its scores a slice of queries at a time: slices of 2 queries,
    each over the keys of its own windows, give the whole."""
    monkeypatch.setattr(attention, "HAND_SCORES", 2 * HEADS * 16)
    meta, inputs, (q, k, v), cache, contexts = _prefill_case()
    store_kv(k, v, cache, meta)
    out = paged_attention(q, k, v, cache, meta, SCALE, window=window, softcap=softcap)
    positions = inputs[1]
    want = torch.cat([_reference(q[:10], *contexts[0], positions[:10], window, softcap),
                      _reference(q[10:], *contexts[1], positions[10:], window, softcap)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


DECODE_LENGTHS = [1, 5, 9, 22]  # one token, within a block, several blocks, longer than 8 keys


def _decode_meta(path: str, lens: torch.Tensor, tables: torch.Tensor, monkeypatch):
    spec = KVCacheSpec(1, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    if path == "static":  # a CUDA graph's: every row over the table's full width
        return static_decode_metadata(lens - 1, tables, spec)
    if path.startswith("triton"):  # a CUDA graph's where Triton's kernel reads in place
        return static_decode_metadata(lens - 1, tables, spec, in_place=True)
    if path == "groups":  # each length its own group
        monkeypatch.setattr(attention_inputs, "GROUP_SLACK_TOKENS", 0)
    meta = decode_metadata(lens - 1, tables, spec, paged_kernel=path == "kernel")
    if path == "groups":
        assert len(meta.decode_groups) > 1
    return meta


DECODE_PATHS = [pytest.param("kernel", marks=needs_kernel), "grouped", "groups", "static",
                "triton", "triton-split"]


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("window,softcap", CASES, ids=CASE_IDS)
def test_decode_rows_of_different_lengths(path, window, softcap, monkeypatch, request):
    if path.startswith("triton"):  # its kernel, under Triton's interpreter, on CPU tensors
        monkeypatch.setattr(decode_backend, "paged_attention",
                            request.getfixturevalue("triton_kernel"))
    if path == "triton-split":  # rows' blocks shared among programs as the shapes choose
        monkeypatch.setattr(triton_shapes, "MIN_SPLIT_TOKENS", BLOCK_SIZE)
    tables, qkv = _sequences(DECODE_LENGTHS, seed=1)
    cache = _cache()
    for row, (_, k, v) in enumerate(qkv):
        _write(cache, tables[row], k[:-1], v[:-1])
    lens = torch.tensor(DECODE_LENGTHS)
    meta = _decode_meta(path, lens, tables, monkeypatch)
    q, k, v = (torch.stack([part[-1] for part in parts]) for parts in zip(*qkv))
    store_kv(k, v, cache, meta)
    out = paged_attention(q, k, v, cache, meta, SCALE, window=window, softcap=softcap)
    for row, (q_all, k_all, v_all) in enumerate(qkv):
        want = _reference(q_all[-1:], k_all, v_all, lens[row:row + 1] - 1, window, softcap)
        torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [12, 64], ids=["scalar-dim", "vector-dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
def test_the_kernel_reads_only_the_window(head_dim, dtype):
    """The kernel's other loops (a head size its 8-wide rows do not divide; one its widest do) and a
    bf16 cache, windows and caps alike. Every row outside a window is NaN: read, it would spread."""
    lengths = [3, 8, 17, 30]
    tables, qkv = _sequences(lengths, head_dim=head_dim, seed=2)
    cache = _cache(head_dim, dtype)
    for row, (_, k, v) in enumerate(qkv):
        _write(cache, tables[row], k, v)
    q = torch.stack([part[0][-1] for part in qkv])
    lens = torch.tensor(lengths)
    for window, softcap in [(5, None), (8, CAP), (1, CAP), (None, CAP)]:
        poisoned = LayerCache(cache.key.clone(), cache.value.clone())
        if window is not None:
            for row, length in enumerate(lengths):
                if length > window:
                    _write(poisoned, tables[row], torch.full((length - window, KV_HEADS, head_dim),
                                                             float("nan")),
                           torch.full((length - window, KV_HEADS, head_dim), float("nan")))
        out = paged_kernel.paged_decode_attention(q, poisoned.key, poisoned.value, tables, lens,
                                                  SCALE, window=window, softcap=softcap)
        for row, (_, k, v) in enumerate(qkv):
            # the keys and values as the cache holds them
            k, v = k.to(dtype).double(), v.to(dtype).double()
            want = _reference(q[row:row + 1], k, v, lens[row:row + 1] - 1, window, softcap)
            torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("window,softcap", [(3, CAP), (64, None)], ids=["window-3-cap",
                                                                        "window-64"])
def test_decode_rows_riding_in_a_prefill(path, window, softcap, monkeypatch):
    """A running batch's next tokens before a prefill's rows in one forward, as the runner puts
    them (shard.model_runner's _ride_along)."""
    meta, inputs, (q, k, v), cache, contexts = _prefill_case()
    _route(meta, inputs, "mixed" if path == "kernel" else "pytorch")
    # blocks the prefill does not use
    tables, qkv = _sequences(DECODE_LENGTHS, seed=3, blocks=range(32, NUM_BLOCKS))
    for row, (_, dk, dv) in enumerate(qkv):
        _write(cache, tables[row], dk[:-1], dv[:-1])
    lens = torch.tensor(DECODE_LENGTHS)
    part = _decode_meta(path, lens, tables, monkeypatch)
    meta.slot_blocks = torch.cat([part.slot_blocks, meta.slot_blocks])
    meta.slot_offsets = torch.cat([part.slot_offsets, meta.slot_offsets])
    meta.decode_groups, meta.num_decode_rows = part.decode_groups, len(DECODE_LENGTHS)
    meta.decode_tables, meta.decode_context_lens = part.decode_tables, part.decode_context_lens
    dq, dk, dv = (torch.stack([p[-1] for p in parts]) for parts in zip(*qkv))
    q, k, v = torch.cat([dq, q]), torch.cat([dk, k]), torch.cat([dv, v])
    store_kv(k, v, cache, meta)
    out = paged_attention(q, k, v, cache, meta, SCALE, window=window, softcap=softcap)
    split, positions = len(DECODE_LENGTHS), inputs[1]
    for row, (q_all, k_all, v_all) in enumerate(qkv):
        want = _reference(q_all[-1:], k_all, v_all, lens[row:row + 1] - 1, window, softcap)
        torch.testing.assert_close(out[row:row + 1].double(), want, rtol=1e-5, atol=1e-5)
    want = torch.cat([
        _reference(q[split:split + 10], *contexts[0], positions[:10], window, softcap),
        _reference(q[split + 10:], *contexts[1], positions[10:], window, softcap)])
    torch.testing.assert_close(out[split:].double(), want, rtol=1e-5, atol=1e-5)


def test_without_window_or_cap_the_paths_are_the_plain_ones_bit_for_bit(monkeypatch):
    """window=None, softcap=None: prefill through SDPA's causal kernels and decode through the
    grouped matmuls exactly as before they took either (the by-hand attention never runs)."""
    def by_hand(*args):
        raise AssertionError("the windowed prefill ran without a window or a cap")

    monkeypatch.setattr(attention, "_windowed_prefill", by_hand)
    meta, _, (q, k, v), cache, _ = _prefill_case()
    store_kv(k, v, cache, meta)
    out = paged_attention(q, k, v, cache, meta, SCALE)
    fresh = F.scaled_dot_product_attention(
        q[:10].transpose(0, 1).unsqueeze(0), k[:10].transpose(0, 1).unsqueeze(0),
        v[:10].transpose(0, 1).unsqueeze(0), is_causal=True, scale=SCALE, enable_gqa=True)
    index = attention_state.gather_index(meta.block_tables[1:2], 16, cache.key.shape)
    continued = F.scaled_dot_product_attention(
        q[10:].transpose(0, 1).unsqueeze(0),
        attention_state.gather_blocks(cache.key, index)[:, :, :16],
        attention_state.gather_blocks(cache.value, index)[:, :, :16],
        attn_mask=causal_lower_right(7, 16), scale=SCALE, enable_gqa=True)
    plain = torch.cat([x.squeeze(0).transpose(0, 1).reshape(x.shape[2], -1)
                       for x in (fresh, continued)])
    assert torch.equal(out, plain)

    tables, qkv = _sequences(DECODE_LENGTHS, seed=1)
    for row, (_, dk, dv) in enumerate(qkv):
        _write(cache, tables[row], dk, dv)
    lens = torch.tensor(DECODE_LENGTHS)
    meta = _decode_meta("grouped", lens, tables, monkeypatch)
    dq, dk, dv = (torch.stack([part[-1] for part in parts]) for parts in zip(*qkv))
    group = meta.decode_groups[0]
    keys = attention_state.gather_blocks(cache.key, group.gather_index)
    values = attention_state.gather_blocks(cache.value, group.gather_index)
    scores = torch.matmul(dq.view(4, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM),
                          keys.transpose(-1, -2)).float() * SCALE
    scores = scores.masked_fill(~group.mask.view(4, 1, 1, -1), float("-inf"))
    grouped = torch.matmul(scores.softmax(dim=-1), values).reshape(4, HEADS * HEAD_DIM)
    assert torch.equal(paged_attention(dq, dk, dv, cache, meta, SCALE), grouped)


@needs_kernel
def test_the_compiled_steps_operator_takes_the_window_and_cap():
    """What a compiled decode step calls (0: none), checked by PyTorch's operator tests (schema,
    fake tensor) and against the eager call."""
    tables, qkv = _sequences(DECODE_LENGTHS, seed=4)
    cache = _cache()
    for row, (_, k, v) in enumerate(qkv):
        _write(cache, tables[row], k, v)
    q, lens = torch.stack([part[0][-1] for part in qkv]), torch.tensor(DECODE_LENGTHS)
    args = (q, cache.key, cache.value, tables, lens, SCALE, 3, CAP)
    torch.library.opcheck(paged_kernel.paged_decode_attention_op, args,
                          test_utils=("test_schema", "test_faketensor"))
    eager = paged_kernel.paged_decode_attention(*args[:6], window=3, softcap=CAP)
    assert torch.equal(torch.ops.tgi.paged_decode_attention(*args), eager)
    assert torch.equal(torch.ops.tgi.paged_decode_attention(*args[:6], 0, 0.0),
                       paged_kernel.paged_decode_attention(*args[:6]))


@pytest.mark.parametrize("window,softcap", [(0, None), (-4, None), (None, 0.0), (None, -1.0)])
def test_a_window_or_cap_that_attends_to_nothing_is_refused(window, softcap):
    meta, _, (q, k, v), cache, _ = _prefill_case()
    with pytest.raises(ValueError):
        paged_attention(q, k, v, cache, meta, SCALE, window=window, softcap=softcap)


def test_the_c_decode_step_leaves_sliding_window_models_to_the_eager_step(tiny_llama):
    """The C step passes no window to its attention: a Llama whose layers have one (Mistral's
    sliding_window) is turned away with the reason."""
    from shard.decode_paths import c_step
    from shard.distributed import ParallelContext
    from shard.loader import load_model

    loaded = load_model(tiny_llama, dtype=torch.bfloat16, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cache = [LayerCache(torch.zeros(4, 2, 4, loaded.config.head_dim, dtype=torch.bfloat16),
                        torch.zeros(4, 2, 4, loaded.config.head_dim, dtype=torch.bfloat16))]
    before = c_step.unsupported_reason(loaded.model.decode_layout(), cache)
    assert before is None or "sliding window" not in before
    for layer in loaded.model.layers:
        layer.self_attn.window = 4
    assert "sliding window" in c_step.unsupported_reason(loaded.model.decode_layout(), cache)
