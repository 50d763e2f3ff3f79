"""A model's token limits, resolved once from its settings and what its shards say of themselves.

A limit its settings leave unset (None or 0) is derived as TGI derives it: the context from the
model's max_position_embeddings, the longest prompt from the context, the prefill budget from the
longest prompt (smaller on CPU shards that chunk prefills). The KV budget, max_batch_total_tokens,
is the pool the shards allocate at warm-up (router/lifecycle/served_model.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from router.config.model import ModelSettings
from router.errors import ValidationError
from router.inputs.validation import TokenLimits
from router.shards.convert import ShardInfo

# The prefill budget's default where the shards run on CPUs and chunk. Prefill is compute-bound there
# from a few hundred tokens on (benchmarks/matmul_bench.py: about the same time a row at 256 rows as
# at 4,096), so a budget this small costs no throughput while a wave of prompts arriving together
# starts streaming in turns instead of all at the end (32 prompts of 128 tokens: TTFT p50 6.4 s with
# TGI's budget, 4.3 s with this one; 256 was slower again, benchmarks/RESULTS.md).
CPU_PREFILL_TOKENS = 512


def resolve_limits(settings: ModelSettings, info: ShardInfo) -> TokenLimits:
    """The model's token limits; a ValueError names a limit its settings set out of range."""
    context = info.max_position_embeddings
    chunking = info.support_chunking
    total = settings.max_total_tokens or min(4096, context)
    max_input = settings.max_input_tokens or min(4095, total - 1)
    default_prefill = max_input + 50
    if chunking and info.device_type == "cpu":
        default_prefill = min(default_prefill, CPU_PREFILL_TOKENS)
    prefill = settings.max_batch_prefill_tokens or default_prefill
    if max_input >= total:
        raise ValueError(f"max_input_tokens ({max_input}) must be < max_total_tokens ({total})")
    if prefill < max_input and not chunking:
        raise ValueError(f"max_batch_prefill_tokens ({prefill}) < max_input_tokens ({max_input}); "
                         "raise the first")
    if total > context:
        raise ValueError(f"max_total_tokens ({total}) exceeds the model's context ({context})")
    return TokenLimits(max_input, total, prefill)


def check_context(model_id: str, model_dir: str | None, ctx_len: int | None) -> None:
    """A 422 when the `ctx_len` a model's settings ask exceeds its context, said before it starts.

    The context is config.json's max_position_embeddings; a directory without a readable one is
    left to the start to report.
    """
    if ctx_len is None or model_dir is None:
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the start reports what is wrong with the directory
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and ctx_len > context:
        raise ValidationError(f"settings.ctx_len {ctx_len} exceeds the context of model "
                              f"{model_id!r} ({context} tokens)")
