"""Which prefilled sequences Triton's kernel reads from the cache in place (CUDA's selection)."""
import torch

from shard.kernels import decode_backend
from shard.layers.attention_state import LayerCache, PrefillLayout
from shard.layers.prefill_in_place import routed

# fresh, continued, continued with an image, fresh
CACHED = [0, 5, 3, 0]


def _layout():
    return PrefillLayout(query_starts=[0, 4, 6, 9, 12], cached_lens=CACHED,
                         image_spans=[[], [], [(3, 5)], []])


def _cache(dtype):
    shape = (4, 2, 4, 8)
    scales = torch.ones(shape[:3]) if dtype == torch.int8 else None
    return LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), scales,
                      scales)


def test_continued_prompts_read_in_place_and_fresh_ones_only_when_capped(monkeypatch):
    monkeypatch.setattr(decode_backend, "prefill_kernel", lambda device, dtype: object())
    q = torch.zeros(12, 4, 8, dtype=torch.bfloat16)
    cache = _cache(torch.bfloat16)
    # a fresh prompt keeps SDPA's flash kernel; the image's sequence keeps PyTorch's masks
    assert routed(q, cache, _layout(), None) == [1]
    # no fused SDPA takes a cap: the fresh prompts' keys are in the cache unrounded
    assert routed(q, cache, _layout(), 30.0) == [0, 1, 3]
    # an int8 cache rounds them: fresh prompts attend over their own keys
    assert routed(q, _cache(torch.int8), _layout(), 30.0) == [1]


def test_where_triton_does_not_run_nothing_is_read_in_place(monkeypatch):
    monkeypatch.setattr(decode_backend, "prefill_kernel", lambda device, dtype: None)
    assert routed(torch.zeros(12, 4, 8), _cache(torch.float32), _layout(), 30.0) == []
    monkeypatch.undo()  # the real selection: CPU tensors never go to Triton
    assert routed(torch.zeros(12, 4, 8), _cache(torch.float32), _layout(), 30.0) == []
