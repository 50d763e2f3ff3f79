"""Build an Engine over a model directory and drive it the way the router does (no gRPC)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from shard.batch import NewRequest
from shard.distributed import ParallelContext
from shard.engine import Engine
from shard.loader import load_model
from shard.model_runner import KVCacheSpec, ModelRunner
from shard.sampling import SamplingParams


def make_engine(model_dir: Path, *, block_size: int = 4, num_blocks: int = 512,
                dtype: torch.dtype = torch.float32) -> Engine:
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                       dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(num_blocks)
    return Engine(loaded, runner)


class BlockPool:
    """A minimal stand-in for the router's allocator: hands out block ids, takes them back."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, 0, -1))

    def take(self, num_tokens: int, block_size: int) -> list[int]:
        return [self.free.pop() for _ in range(math.ceil(num_tokens / block_size))]

    def give(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def request(rid: int, input_ids: list[int], blocks: list[int], *, max_new_tokens: int = 8,
            **params) -> NewRequest:
    top_n = params.pop("top_n_tokens", 0)
    stopping = {k: params.pop(k) for k in ("stop_sequences", "ignore_eos", "min_new_tokens",
                                           "prefill_logprobs") if k in params}
    return NewRequest(id=rid, input_ids=list(input_ids),
                      params=SamplingParams(top_n_tokens=top_n, **params),
                      max_new_tokens=max_new_tokens, blocks=blocks, **stopping)


def run_to_completion(engine: Engine, requests: list[NewRequest], batch_id: int = 1
                      ) -> dict[int, list[int]]:
    """Prefills `requests` together, then decodes, filtering finished ones as the router does."""
    out = engine.prefill(batch_id, requests)
    tokens: dict[int, list[int]] = {r.id: [] for r in requests}
    while True:
        finished = set()
        for generation in out.generations:
            tokens[generation.request_id] += generation.tokens.ids
            if generation.generated_text is not None:
                finished.add(generation.request_id)
        if out.batch is None:
            return tokens
        alive = [r for r in out.batch.request_ids if r not in finished]
        if not alive:
            engine.clear(out.batch.id)
            return tokens
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        out = engine.decode([out.batch.id])
