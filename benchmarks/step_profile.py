"""Where one decode step's time goes, inside a shard's engine (no gRPC): the step timed whole, then
the same steps under torch.profiler, its operators by self time on the host and on the device.

    python benchmarks/step_profile.py --model-dir DIR [--device cuda --cuda-graphs 1,2,4,8]
        [--dtype bfloat16] [--quantize int4] [--batch 1] [--prompt-length 128] [--steps 32]
        [--steps-per-call 8]

Prints the step's p50 and the top operators; --json writes the figures. With --steps-per-call N
each call takes N steps (the router's multi-step calls; on CUDA each step after the first queued
while the host reads the one before) and a step's time is the call's over N.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from shard.batch_state import NewRequest
from shard.config import parse_cuda_graphs
from shard.distributed import ParallelContext
from shard.engine import Engine
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner
from shard.sampling import SamplingParams

BLOCK_SIZE = 16


def new_tokens(args) -> int:
    """Tokens each request may take: every timed, warm-up and profiled step, with room."""
    return args.steps * 2 + 4 * max(1, args.steps_per_call) + 4


def build_engine(args) -> Engine:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(Path(args.model_dir), dtype=dtype, device=device,
                        parallel=ParallelContext(), quantize=args.quantize or None)
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, loaded.heads.num_kv_heads, cfg.head_dim, BLOCK_SIZE,
                       dtype, device)
    runner = ModelRunner(loaded.model, spec, cuda_graphs=parse_cuda_graphs(args.cuda_graphs))
    blocks_per_request = math.ceil((args.prompt_length + new_tokens(args) + 4) / BLOCK_SIZE)
    runner.allocate(args.batch * blocks_per_request + 1)
    runner.warm_decode(args.prompt_length + new_tokens(args) + 4)
    return Engine(loaded, runner)


def new_requests(args, vocab_size: int) -> list[NewRequest]:
    blocks_per_request = math.ceil((args.prompt_length + new_tokens(args) + 4) / BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(args.batch):
        prompt = torch.randint(3, vocab_size, (args.prompt_length,), generator=generator).tolist()
        first = 1 + i * blocks_per_request
        requests.append(NewRequest(id=i + 1, input_ids=prompt, params=SamplingParams(),
                                   max_new_tokens=new_tokens(args), ignore_eos=True,
                                   blocks=list(range(first, first + blocks_per_request))))
    return requests


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="")
    parser.add_argument("--cuda-graphs", default="0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--steps-per-call", type=int, default=1)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    engine = build_engine(args)
    out = engine.prefill(1, new_requests(args, engine.vocab_size))
    batch_id = out.batch.id
    per_call = max(1, args.steps_per_call)
    for _ in range(3):  # warm-up steps
        engine.decode([batch_id], per_call)
    times = []
    for _ in range(max(1, args.steps // per_call)):
        synchronize(args.device)
        start = time.perf_counter()
        taken = engine.decode([batch_id], per_call).steps
        synchronize(args.device)
        times.append((time.perf_counter() - start) / taken)
    p50_ms = statistics.median(times) * 1e3

    activities = [ProfilerActivity.CPU]
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        activities.append(ProfilerActivity.CUDA)
    profiled_steps = 0
    with profile(activities=activities) as prof:
        while profiled_steps < max(4, args.steps // 4):
            profiled_steps += engine.decode([batch_id], per_call).steps
        synchronize(args.device)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / profiled_steps if on_gpu else 0.0
    torch_host_us = sum(e.self_cpu_time_total for e in events) / profiled_steps
    print(f"device {args.device}, dtype {args.dtype}, quantize {args.quantize or '-'}, "
          f"CUDA graphs {args.cuda_graphs}, batch {args.batch}, prompt {args.prompt_length}, "
          f"{per_call} step(s) a call")
    print(f"decode step p50 {p50_ms:.2f} ms ({args.batch / (p50_ms / 1e3):.1f} tok/s)"
          + (f"; device busy {device_us / 1e3:.2f} ms a step" if on_gpu else ""))
    # the rest of a step is Python, and C kernels called outside torch's operators
    print(f"torch operators on the host: {torch_host_us / 1e3:.2f} ms a step")
    print("\nby self time on the host (per step):")
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    for e in rows:
        print(f"  {e.self_cpu_time_total / profiled_steps / 1e3:8.3f} ms  {e.count // profiled_steps:5d}x  "
              f"{e.key[:70]}")
    if on_gpu:
        print("\nby self time on the device (per step):")
        rows = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:args.top]
        for e in rows:
            print(f"  {e.self_device_time_total / profiled_steps / 1e3:8.3f} ms  "
                  f"{e.count // profiled_steps:5d}x  {e.key[:70]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "step_p50_ms": p50_ms, "device_busy_ms": device_us / 1e3,
            "torch_host_ms": torch_host_us / 1e3,
            "host_top": [{"op": e.key, "self_ms": e.self_cpu_time_total / profiled_steps / 1e3}
                         for e in sorted(events, key=lambda e: e.self_cpu_time_total,
                                         reverse=True)[:args.top]]}, indent=2))


if __name__ == "__main__":
    main()
