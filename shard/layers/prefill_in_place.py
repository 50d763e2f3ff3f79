"""Which prefilled sequences read their context from the paged cache in place, and that read.

On CUDA with Triton (shard.kernels.decode_backend.prefill_kernel) a continued prompt's new tokens
attend over their cached prefix through shard.kernels.triton_prefill instead of gathering it into
a copy for SDPA. A fresh prompt keeps SDPA's flash kernel over its own keys, unless its scores are
soft-capped (no fused SDPA takes the cap) and the cache holds its keys unrounded. A sequence with
images attending both ways (Gemma 3's) keeps PyTorch's masks.
"""
from __future__ import annotations

import torch

from shard.kernels import decode_backend
from shard.layers.attention_state import AttentionMetadata, LayerCache, PrefillLayout


def routed(q: torch.Tensor, cache: LayerCache, layout: PrefillLayout,
           softcap: float | None) -> list[int]:
    """The prefill's sequences (indices) that Triton's kernel reads in place; [] where none."""
    if decode_backend.prefill_kernel(q.device, cache.key.dtype) is None:
        return []
    exact = q.dtype == cache.key.dtype  # a fresh prompt's keys are in the cache as they are
    spans = layout.image_spans
    return [b for b, cached in enumerate(layout.cached_lens)
            if not (spans is not None and spans[b])
            and (cached > 0 or (softcap is not None and exact))]


def attend(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, sequences: list[int],
           scale: float,
           window: int | None, softcap: float | None) -> torch.Tensor:
    """[T, heads * d]: the rows of `sequences` attended from the cache, the others unwritten."""
    layout = meta.prefill
    kernel = decode_backend.prefill_kernel(q.device, cache.key.dtype)
    return kernel.paged_prefill_attention(q, cache.key, cache.value, meta.block_tables,
                                          layout.query_starts, layout.cached_lens, sequences,
                                          scale, window=window, softcap=softcap,
                                          key_scales=cache.key_scale,
                                          value_scales=cache.value_scale, memo=layout.tile_index)
