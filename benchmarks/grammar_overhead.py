"""What one grammar-constrained request costs the unconstrained requests decoding beside it.

Runs the engine in process on the same weights: a batch of B unconstrained requests plus one more
request that is either unconstrained (baseline) or JSON-schema constrained, and compares the decode
speed the B unconstrained requests get. Prints a table; writes JSON with --json.

    python benchmarks/grammar_overhead.py [--model-dir DIR] [--batch 16] [--steps 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.batch_state import NewRequest  # noqa: E402
from shard.distributed import ParallelContext  # noqa: E402
from shard.engine import Engine  # noqa: E402
from shard.kv_budget import KVCacheSpec  # noqa: E402
from shard.loader import load_model  # noqa: E402
from shard.model_runner import ModelRunner  # noqa: E402
from shard.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 400},
    "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 400}},
    "required": ["name", "items"], "additionalProperties": False}


def _engine(model_dir: Path, dtype: torch.dtype, num_blocks: int) -> Engine:
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, 16, dtype, torch.device("cpu")))
    runner.allocate(num_blocks)
    return Engine(loaded, runner)


def _requests(engine: Engine, batch: int, steps: int, constrained: bool) -> list[NewRequest]:
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.").ids
    blocks_each = -(-(len(prompt) + steps + 1) // 16)
    out = []
    for i in range(batch + 1):
        blocks = list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each))
        request = NewRequest(id=i, input_ids=prompt, params=SamplingParams(),
                             max_new_tokens=steps + 1, ignore_eos=True, blocks=blocks)
        if constrained and i == batch:
            request.grammar = ("json", json.dumps(SCHEMA))
        out.append(request)
    return out


def decode_seconds(engine: Engine, batch: int, steps: int, constrained: bool) -> float:
    """Wall time of `steps` decode steps of the batch (prefill excluded)."""
    engine.clear()
    result = engine.prefill(1, _requests(engine, batch, steps, constrained))
    started = time.perf_counter()
    for _ in range(steps):
        result = engine.decode([result.batch.id])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model_dir is None:
        from launcher.prepare import prepare_default_model

        args.model_dir = prepare_default_model(dtype="float32")
    engine = _engine(args.model_dir, getattr(torch, args.dtype),
                     num_blocks=(args.batch + 2) * (-(-(args.steps + 64) // 16)) + 2)
    decode_seconds(engine, args.batch, args.steps, False)  # warm-up: allocator, caches, threads
    decode_seconds(engine, args.batch, args.steps, True)
    plain, constrained = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        plain.append(decode_seconds(engine, args.batch, args.steps, False))
        constrained.append(decode_seconds(engine, args.batch, args.steps, True))
    best_plain, best_constrained = min(plain), min(constrained)
    unconstrained_tokens = args.batch * args.steps
    figures = {
        "batch": args.batch, "steps": args.steps, "dtype": args.dtype,
        "unconstrained_tok_s_with_plain_neighbour": unconstrained_tokens / best_plain,
        "unconstrained_tok_s_with_constrained_neighbour": unconstrained_tokens / best_constrained,
        "slowdown_percent": 100 * (best_constrained / best_plain - 1),
    }
    print(f"{args.batch} unconstrained requests + 1 neighbour, {args.steps} decode steps, "
          f"{args.dtype}, best of {args.repeats}")
    print(f"{'neighbour':<14}{'decode s':>10}{'unconstrained tok/s':>22}")
    print(f"{'plain':<14}{best_plain:>10.3f}{figures['unconstrained_tok_s_with_plain_neighbour']:>22.1f}")
    print(f"{'JSON schema':<14}{best_constrained:>10.3f}"
          f"{figures['unconstrained_tok_s_with_constrained_neighbour']:>22.1f}")
    print(f"slowdown of the unconstrained requests: {figures['slowdown_percent']:.1f}%")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
