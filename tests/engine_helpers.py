"""Build an Engine over a model directory and drive it the way the router does (no gRPC)."""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from shard.batch_state import NewRequest
from shard.distributed import ParallelContext
from shard.engine import Engine
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from shard.outputs import StepOutput
from shard.sampling import SamplingParams


def make_engine(model_dir: Path, *, block_size: int = 4, num_blocks: int = 512,
                dtype: torch.dtype = torch.float32, speculate: int = 0,
                compile_decode: bool = False, device: str = "cpu",
                cuda_graphs: list[int] | None = None, new_capture=None,
                max_total_tokens: int = 0, kv_int8: bool = False) -> Engine:
    """An engine with its pool allocated and its decode step warmed (compiled or captured, when
    asked: `cuda_graphs` on a CUDA device, or anywhere with `new_capture`); `kv_int8`: an int8 KV
    cache (--kv-cache-dtype int8)."""
    loaded = load_model(model_dir, dtype=dtype, device=torch.device(device),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                       dtype, torch.device(device), int8=kv_int8)
    runner = ModelRunner(loaded.model, spec, compile_decode=compile_decode,
                         cuda_graphs=cuda_graphs, new_capture=new_capture)
    runner.allocate(num_blocks)
    runner.warm_decode(max_total_tokens)
    return Engine(loaded, runner, speculate=speculate)


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


def steps_to_completion(engine: Engine, requests: list[NewRequest], batch_id: int = 1
                        ) -> Iterator[StepOutput]:
    """Prefills `requests` together, then decodes, filtering finished ones as the router does;
    yields each step's result."""
    out = engine.prefill(batch_id, requests)
    finished: set[int] = set()
    while True:
        yield out
        finished |= {g.request_id for g in out.generations if g.generated_text is not None}
        if out.batch is None:
            return
        alive = [r for r in out.batch.request_ids if r not in finished]
        if not alive:
            engine.clear(out.batch.id)
            return
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        out = engine.decode([out.batch.id])


def run_to_completion(engine: Engine, requests: list[NewRequest], batch_id: int = 1
                      ) -> dict[int, list[int]]:
    """Each request's tokens, from steps_to_completion."""
    tokens: dict[int, list[int]] = {r.id: [] for r in requests}
    for out in steps_to_completion(engine, requests, batch_id):
        for generation in out.generations:
            tokens[generation.request_id] += generation.tokens.ids
    return tokens


def prefill_logits(model_dir: Path, dtype: torch.dtype,
                   prompt: tuple[int, ...] = (5, 17, 42, 99, 3, 25, 7, 11, 30)):
    """(the loaded model, float32 logits of every row of one prefill of `prompt`)."""
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, dtype,
                       torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(16)
    blocks = list(range(-(-len(prompt) // 4)))
    out = runner.prefill([PrefillSequence(list(prompt), 0, blocks)], all_logits_rows={0})
    return loaded, out.full[0].float()
