"""What LoRA adapters cost a shard's decode speed, over gRPC as engine_bench.py drives a shard.

One shard process runs every scenario: the base model with no adapter loaded; then, with four
adapters loaded, the base model, every request on one adapter, and the requests round-robin over the
four, these three as batches decoded a step of each in turn, so that the machine's noise falls on
them alike. Several such rounds; decode tokens/s per batch size (the median over rounds), each
scenario's cost against the base model, issue 33's bounds at 32 streams (one adapter: at most 15%,
four adapters: at most 25%) and, for information, prefill. The shard runs with the OpenMP settings
the launcher gives it. The adapters are made with peft (random non-zero A and B on all seven
projections) and cached in the temp directory. Prints tables; writes JSON with --json.

    python benchmarks/lora_bench.py [--model-dir DIR] [--rank 16 | --ranks 8,16,64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_bench import (ShardDriver, _check_admitted, _ints,  # noqa: E402
                                     run_decode, run_prefill, start_shard, summary)
from launcher.shard_group import openmp_environment  # noqa: E402
from proto import generate_pb2 as pb  # noqa: E402
from proto import generate_pb2_grpc as pb_grpc  # noqa: E402

ADAPTERS = 4  # the "four adapters" scenario's, loaded together
STREAMS = 32  # the batch issue 33's bounds are set at
BOUNDS = {"one": 15.0, "four": 25.0}  # largest cost, % of the base model's tokens/s


def adapter_dirs(model_dir: Path, rank: int, cache: Path) -> list[Path]:
    """ADAPTERS adapters of `rank` for the model, built once per model directory and rank."""
    from tests.lora_adapters import build_adapter

    # another model put at the same path gets adapters of its own shapes
    model_key = hashlib.sha256(str(model_dir.resolve()).encode()
                               + (model_dir / "config.json").read_bytes()).hexdigest()[:12]
    out = []
    for seed in range(1, ADAPTERS + 1):
        target = cache / f"{model_dir.name}-{model_key}" / f"r{rank}-seed{seed}"
        if not (target / "adapter_config.json").exists():
            # built beside its place and renamed into it: an interrupted build leaves no half
            target.parent.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
            build_adapter(model_dir, building, rank=rank, alpha=2 * rank, seed=seed)
            shutil.rmtree(target, ignore_errors=True)
            building.rename(target)
        out.append(target)
    return out


def adapters_of(scenario: str, names: list[str]) -> list[str]:
    """The adapter of each request, round-robin (empty: every request on the base model)."""
    return {"base": [], "base_loaded": [], "one": names[:1], "four": names}[scenario]


async def check_adapters_apply(driver: ShardDriver, names: list[str], prompt_length: int) -> None:
    """Each adapter's request gets another first token log-probability than the base model's on
    the same prompt: an adapter_id the shard ignored would time the base model under its name."""
    batch, held = driver.batch(1 + len(names), prompt_length, 2, [None, *names])
    for request in batch.requests[1:]:
        request.input_ids[:] = batch.requests[0].input_ids
    reply = await driver.stub.Prefill(pb.PrefillRequest(batch=batch))
    _check_admitted(reply, 1 + len(names))
    await driver.stub.ClearCache(pb.ClearCacheRequest(id=reply.batch.id))
    driver.release(held)
    first = {g.request_id: (g.tokens.ids[0], g.tokens.logprobs[0]) for g in reply.generations}
    base, *adapted = (first[r.id] for r in batch.requests)
    same = [name for name, got in zip(names, adapted) if got == base]
    if same:
        raise RuntimeError(f"adapters {same} changed nothing: the shard did not apply them")


async def decode_side_by_side(driver: ShardDriver, batch_size: int, prompt_length: int,
                              steps: int, warmup: int, adapters: dict[str, list[str]]
                              ) -> dict[str, list[float]]:
    """One batch per scenario, prefilled together, then decoded a step of each in turn, so that
    the machine's noise falls on every scenario alike: each one's step latencies."""
    cached, held = {}, []
    for scenario, names in adapters.items():
        batch, blocks = driver.batch(batch_size, prompt_length, steps + warmup + 1, names)
        reply = await driver.stub.Prefill(pb.PrefillRequest(batch=batch))
        _check_admitted(reply, batch_size)
        cached[scenario] = reply.batch
        held += blocks
    latencies: dict[str, list[float]] = {scenario: [] for scenario in cached}
    for step in range(steps + warmup):
        for scenario, batch in cached.items():
            started = time.perf_counter()
            reply = await driver.stub.Decode(pb.DecodeRequest(batches=[batch]))
            if step >= warmup:
                latencies[scenario].append(time.perf_counter() - started)
            cached[scenario] = reply.batch
    for batch in cached.values():
        await driver.stub.ClearCache(pb.ClearCacheRequest(id=batch.id))
    driver.release(held)
    return latencies


async def run_round(driver: ShardDriver, args, dirs: dict[int, list[Path]], record) -> None:
    """Every scenario at every batch size; record(scenario, rank, kind, batch, latencies). The
    base model with nothing loaded runs alone (loading and unloading are not steps); the others
    side by side, a step each in turn."""
    for batch in args.batch_sizes:
        record("base", None, "decode", batch,
               await run_decode(driver, batch, args.decode_prompt, args.steps, args.warmup))
    record("base", None, "prefill", args.prefill_batch,
           await run_prefill(driver, args.prefill_batch, args.prefill_prompt,
                             args.prefill_repeats))
    for rank in args.ranks:
        names = [f"r{rank}-{i}" for i in range(ADAPTERS)]
        for name, path in zip(names, dirs[rank]):
            await driver.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=str(path)))
        await check_adapters_apply(driver, names, args.prefill_prompt)
        scenarios = {s: adapters_of(s, names) for s in ("base_loaded", "one", "four")}
        for batch in args.batch_sizes:
            side = await decode_side_by_side(driver, batch, args.decode_prompt, args.steps,
                                             args.warmup, scenarios)
            for scenario, lat in side.items():
                record(scenario, rank, "decode", batch, lat)
        prefills: dict[str, list[float]] = {scenario: [] for scenario in scenarios}
        for _ in range(args.prefill_repeats):
            for scenario, adapters in scenarios.items():
                prefills[scenario] += await run_prefill(driver, args.prefill_batch,
                                                        args.prefill_prompt, 1, adapters)
        for scenario, lat in prefills.items():
            record(scenario, rank, "prefill", args.prefill_batch, lat)
        # the next round's base runs with nothing loaded; the next rank's stacks start afresh
        for name in names:
            await driver.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name))


async def bench(args, dirs: dict[int, list[Path]]) -> dict:
    socket_prefix = os.path.join(tempfile.mkdtemp(), "lora-bench")
    shard = start_shard(args.model_dir, args.dtype, socket_prefix, device=args.device)
    try:
        channel = grpc.aio.insecure_channel(f"unix://{socket_prefix}-0")
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(pb.InfoRequest())
        per_request = max(args.decode_prompt, args.prefill_prompt) + args.steps + args.warmup + 64
        # three batches of the largest size side by side
        tokens = 3 * max(*args.batch_sizes, args.prefill_batch) * per_request
        warm = await stub.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0), max_input_tokens=1,
                                                  max_prefill_tokens=1,
                                                  max_total_tokens=per_request,
                                                  max_batch_total_tokens=tokens))
        vocab_size = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
        driver = ShardDriver(stub, info.block_size, warm.num_blocks, vocab_size)
        runs: dict[tuple, list[dict]] = {}

        def record(scenario, rank, kind, batch, lat):
            runs.setdefault((scenario, rank, kind, batch), []).append(
                {"latency_s": summary(lat), "tokens_per_s": batch * (
                    args.prefill_prompt if kind == "prefill" else 1) / statistics.median(lat)})

        await run_decode(driver, 1, 16, 4, 2)  # process warm-up
        # a short round first, its figures dropped: every path built and warm before timing
        warm_round = argparse.Namespace(**{**vars(args), "steps": 2, "prefill_repeats": 1})
        await run_round(driver, warm_round, dirs, lambda *_: None)
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):
            await run_round(driver, args, dirs, record)
        load_after = os.getloadavg()[0]
        await channel.close()
    finally:
        shard.terminate()
        shard.wait(timeout=30)
    results = figures(runs)
    results.update({"device": info.device_type, "dtype": info.dtype, "cpu": cpu_name(),
                    "cpus": os.cpu_count(), "load_average": [load_before, load_after],
                    "model": str(args.model_dir), "ranks": args.ranks, "adapters": ADAPTERS,
                    "rounds": args.rounds, "steps": args.steps,
                    "decode_prompt": args.decode_prompt})
    return results


def figures(runs: dict[tuple, list[dict]]) -> dict:
    """Each scenario's median over rounds; its cost against the base model with nothing loaded
    (measured in the same rounds) and against the base model decoding beside it (the same steps,
    interleaved: the finer comparison on a noisy machine); the bounds at STREAMS streams."""
    rows = []
    for (scenario, rank, kind, batch), rounds in runs.items():
        rates = [r["tokens_per_s"] for r in rounds]
        rows.append({"scenario": scenario, "rank": rank, "kind": kind, "batch": batch,
                     "tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
                     "latency_p50_s": statistics.median(r["latency_s"]["p50"] for r in rounds)})
    rate = {(r["scenario"], r["rank"], r["kind"], r["batch"]): r["tokens_per_s"] for r in rows}
    for row in rows:
        base = rate[("base", None, row["kind"], row["batch"])]
        row["cost_percent"] = 100 * (base - row["tokens_per_s"]) / base
        if row["scenario"] in BOUNDS:
            beside = rate[("base_loaded", row["rank"], row["kind"], row["batch"])]
            row["cost_beside_percent"] = 100 * (beside - row["tokens_per_s"]) / beside
    bounds = [{"scenario": row["scenario"], "rank": row["rank"],
               "cost_percent": row["cost_percent"],
               "cost_beside_percent": row["cost_beside_percent"],
               "limit_percent": BOUNDS[row["scenario"]],
               "within": row["cost_percent"] <= BOUNDS[row["scenario"]]}
              for row in rows if row["kind"] == "decode" and row["batch"] == STREAMS
              and row["scenario"] in BOUNDS]
    return {"rows": rows, "bounds": bounds}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


LABELS = {"base": "base", "base_loaded": f"base, {ADAPTERS} loaded", "one": "1 adapter",
          "four": f"{ADAPTERS} adapters"}


def print_tables(results: dict) -> None:
    load = results["load_average"]
    print(f"{results['cpu']} ({results['cpus']} CPUs; load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after), device {results['device']}, dtype {results['dtype']}, "
          f"{results['model']}")
    print(f"median of {results['rounds']} rounds; decode: {results['steps']} steps after "
          f"{results['decode_prompt']}-token prompts; cost = (base - x) / base, against the base "
          f"with nothing loaded and against the base decoding beside it")
    for kind in ("decode", "prefill"):
        rows = [r for r in results["rows"] if r["kind"] == kind]
        print(f"\n{kind:<8}{'scenario':<16}{'rank':>5}{'batch':>6}{'p50 ms':>9}{'tok/s':>9}"
              f"{'cost':>8}{'beside':>8}  tok/s per round")
        for r in sorted(rows, key=lambda r: (r["batch"], r["rank"] or 0,
                                             list(LABELS).index(r["scenario"]))):
            beside = f"{r['cost_beside_percent']:.1f}%" if "cost_beside_percent" in r else ""
            spread = " ".join(f"{x:.0f}" for x in r["rounds_tokens_per_s"])
            print(f"{'':<8}{LABELS[r['scenario']]:<16}{r['rank'] or '-':>5}{r['batch']:>6}"
                  f"{r['latency_p50_s'] * 1e3:>9.1f}{r['tokens_per_s']:>9.1f}"
                  f"{r['cost_percent']:>7.1f}%{beside:>8}  {spread}")
    print()
    for bound in results["bounds"]:
        print(f"at {STREAMS} streams, {LABELS[bound['scenario']]} (rank {bound['rank']}) cost "
              f"{bound['cost_percent']:.1f}% of the base model's tokens/s "
              f"({bound['cost_beside_percent']:.1f}% against the base beside it; at most "
              f"{bound['limit_percent']:.0f}%): {'within' if bound['within'] else 'OVER'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--ranks", "--rank", type=_ints, default=[16],
                        help="the adapters' rank; several (8,16,64) measure each in turn")
    parser.add_argument("--batch-sizes", type=_ints, default=_ints(f"1,8,{STREAMS}"))
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-prompt", type=int, default=128)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--adapter-cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "tgi-py-lora-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model_dir is None:
        from launcher.prepare import prepare_default_model

        args.model_dir = prepare_default_model(dtype="float32")
    os.environ.update(openmp_environment(os.environ))  # as the launcher starts a shard
    dirs = {rank: adapter_dirs(args.model_dir, rank, args.adapter_cache) for rank in args.ranks}
    results = asyncio.run(bench(args, dirs))
    print_tables(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
