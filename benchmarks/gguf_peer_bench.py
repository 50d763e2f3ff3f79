"""A GGUF of a real model's shape served by tgi-py (as stored, the default) and by llama.cpp.

For each shape (benchmarks/gguf_shapes.py: random Q4_K_M blocks, SmolLM2's tokenizer), one server
at a time, the same requests against each: the resident memory of all the server's processes after
its start and a warm-up request, then one stream (TTFT, TPOT), 8 and 32 streams (tokens/s). Each
request: a unique prompt of --prompt-tokens tokens, exactly --new-tokens new tokens (EOS ignored),
greedy, streamed from /v1/completions. Both servers hold the same KV context: llama-server's
32 slots of 320 tokens (../shared/peers/llama-cpp.sh), ours --max-batch-total-tokens 10240.

    .venv/bin/python benchmarks/gguf_peer_bench.py --shapes llama3.2-1b,llama3-8b --json /tmp/g.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gguf_shapes  # noqa: E402
from benchmarks.engine_bench import _ints  # noqa: E402
from benchmarks.http_bench import load, prompt_text, start_peer, wait_until_ready  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"
SLOTS, SLOT_TOKENS = 32, 320


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_bytes(pid: int) -> int:
    """RSS of a process and every descendant (a launcher's router and shards; a shell's server)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def start_ours(gguf: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher", "--model-id", str(gguf), "--port", str(port),
         "--hostname", "127.0.0.1", "--shard-uds-path", f"/tmp/tgi-py-gguf-bench-{port}",
         "--max-batch-total-tokens", str(SLOTS * SLOT_TOKENS), "--max-total-tokens",
         str(SLOT_TOKENS), "--max-input-tokens", str(SLOT_TOKENS - 1), *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # a first start converts the file (a few seconds a GB)
    wait_until_ready(process, f"{url}/health", 1800, "tgi-py")
    return process, url


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def run(name: str, gguf: Path, args, prompts: dict) -> dict:
    began = time.perf_counter()
    if name == "tgi-py":
        process, url = start_ours(gguf, args.server_arg)
        model = "tgi-py"
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = start_peer(f"bash {args.llamacpp_script} {gguf} {port} {SLOTS}", url,
                             timeout=3600, log=args.log_dir / "gguf-bench-llamacpp.log")
        model = "peer"
    result = {"start_s": time.perf_counter() - began, "runs": []}
    try:
        asyncio.run(load(url, prompts["warm_up"], 1, args.new_tokens, None, route="completions",
                         model=model, warm=False))
        result["rss_bytes"] = resident_bytes(process.pid)
        print(f"  {name:<10} resident {result['rss_bytes'] / 2**30:6.2f} GiB after start "
              f"({result['start_s']:.0f} s) and a warm-up request", flush=True)
        for concurrency in args.concurrency:
            report = asyncio.run(load(url, prompts[concurrency], concurrency, args.new_tokens,
                                      None, route="completions", model=model, warm=False))
            report.pop("request_ttft_s", None)
            result["runs"].append(report)
            print(f"  {name:<10} C={concurrency:<3} {report['output_tok_s']:7.1f} tok/s   TTFT "
                  f"p50 {report['ttft_s'][50] * 1e3:7.0f} ms   TPOT p50 "
                  f"{report['tpot_s'] * 1e3:6.1f} ms", flush=True)
    finally:
        stop(process)
    return result


def make_prompts(args, tokenizer) -> dict:
    prompts, variant = {}, 1
    for key, count in [("warm_up", 1)] + [(c, max(c * args.requests_per_stream, args.min_requests))
                                          for c in args.concurrency]:
        prompts[key] = [prompt_text(tokenizer, args.prompt_tokens, variant + i)
                        for i in range(int(count))]
        variant += int(count)
    return prompts


def machine() -> str:
    flags = open("/proc/cpuinfo").read()
    isa = ("AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {isa}, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--shapes", default="llama3.2-1b", help=f"comma-separated: {', '.join(gguf_shapes.SHAPES)}")
    add("--servers", default="tgi-py,llama.cpp")
    add("--concurrency", type=_ints, default=_ints("1,8,32"))
    add("--prompt-tokens", type=int, default=128)
    add("--new-tokens", type=int, default=48)
    add("--requests-per-stream", type=float, default=1.0)
    add("--min-requests", type=int, default=3)
    add("--work-dir", type=Path, default=Path(tempfile.gettempdir()),
        help="where the synthetic GGUFs are written (kept for the next run)")
    add("--server-arg", action="append", default=[], help="an extra launcher argument for ours")
    add("--llamacpp-script", type=Path, default=PEERS / "llama-cpp.sh")
    add("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    add("--json", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from launcher.known_models import DEFAULT_MODEL
    from launcher.model_cache import cache_root
    from launcher.prepare import fetch_gguf, prepare_default_model

    tokenizer_gguf = fetch_gguf(DEFAULT_MODEL, cache_root())
    tokenizer = Tokenizer.from_file(str(prepare_default_model(dtype="gguf") / "tokenizer.json"))
    prompts = make_prompts(args, tokenizer)
    results = {"machine": machine(), "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, "shapes": {}}
    print(f"{results['machine']}; {args.prompt_tokens}-token prompts, {args.new_tokens} new "
          "tokens, greedy, EOS ignored, /v1/completions streamed", flush=True)
    for shape in args.shapes.split(","):
        path = args.work_dir / f"{shape}-q4_k_m-synthetic.gguf"
        if not path.exists():
            gguf_shapes.write(shape, path, tokenizer_gguf)
        print(f"{shape}: {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
        results["shapes"][shape] = {"gguf_bytes": path.stat().st_size, "servers": {
            name: run(name, path, args, prompts) for name in args.servers.split(",")}}
        servers = results["shapes"][shape]["servers"]
        if len(servers) == 2:
            ours, peer = servers["tgi-py"], servers["llama.cpp"]
            print(f"  ours / llama.cpp: memory {ours['rss_bytes'] / peer['rss_bytes']:.2f}x; "
                  + ", ".join(f"C={a['concurrency']} tok/s {a['output_tok_s'] / b['output_tok_s']:.2f}x"
                              for a, b in zip(ours["runs"], peer["runs"])), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
