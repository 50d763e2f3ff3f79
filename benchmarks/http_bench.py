"""HTTP load benchmark: N streamed requests at concurrency C against tgi-py, then the same prompts
through `transformers`' generate (batch 1 and a static batch of C) on the same weights and dtype, in
the same run, with the ratios.

Every request has exactly --prompt-tokens prompt tokens and produces exactly --new-tokens tokens
(EOS ignored). Reports output tokens/s, time to first token and inter-token latency percentiles.

    python benchmarks/http_bench.py --concurrency 32 --requests 64
    python benchmarks/http_bench.py --url http://127.0.0.1:8080 ...   # a server already running
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_bench import percentile  # noqa: E402

WORDS = ("the lighthouse keeper walked along the shore counting waves and gulls while the tide "
         "rose slowly over the rocks ").split()


def prompt_text(tokenizer, length: int, variant: int) -> str:
    """A text of exactly `length` tokens, different for each variant."""
    words, ids = [], []
    index = variant
    while len(ids) < length:
        words.append(WORDS[index % len(WORDS)])
        index += variant % 7 + 1
        ids = tokenizer.encode(" ".join(words)).ids
    return tokenizer.decode(ids[:length])


async def token_stamps(session, url: str, body: dict, on_first_token=None) -> list[float]:
    """Streams one TGI request; returns when each token arrived."""
    stamps = []
    async with session.post(f"{url}/generate_stream", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{reply.status}: {await reply.text()}")
        async for line in reply.content:
            if line.startswith(b"data:"):
                stamps.append(time.perf_counter())
                if len(stamps) == 1 and on_first_token is not None:
                    on_first_token()
    return stamps


async def one_request(session, url: str, prompt: str, new_tokens: int,
                      prompt_tokens: int | None = None):
    parameters = {"max_new_tokens": new_tokens, "ignore_eos": True}
    if prompt_tokens is not None:
        parameters["truncate"] = prompt_tokens
    body = {"inputs": prompt, "parameters": parameters}
    started = time.perf_counter()
    stamps = await token_stamps(session, url, body)
    ttft = stamps[0] - started
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, itl, len(stamps)


async def load(url: str, prompts: list[str], concurrency: int, new_tokens: int,
               prompt_tokens: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def bounded(prompt):
            async with semaphore:
                return await one_request(session, url, prompt, new_tokens, prompt_tokens)

        await bounded(prompts[0])  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(r[2] for r in results)
    ttfts = [r[0] for r in results]
    itls = [x for r in results for x in r[1]]
    return {"requests": len(prompts), "concurrency": concurrency, "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_s": {q: percentile(ttfts, q) for q in (50, 90, 99)},
            "itl_s": {q: percentile(itls, q) for q in (50, 90, 99)}}


def transformers_baseline(model_dir: Path, dtype: str, prompts_ids: list[list[int]],
                          new_tokens: int, batch: int) -> float:
    """Output tokens/s of transformers' greedy generate over the prompts, `batch` at a time."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).eval()
    chunks = [prompts_ids[i:i + batch] for i in range(0, len(prompts_ids), batch)]
    with torch.inference_mode():
        warm = torch.tensor(chunks[0][:1])
        model.generate(warm, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        started = time.perf_counter()
        for chunk in chunks:
            ids = torch.tensor(chunk)  # every prompt has the same length: no padding needed
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - started
    return sum(len(c) for c in chunks) * new_tokens / wall


def start_server(dtype: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher", "--port", str(port), "--hostname", "127.0.0.1",
         "--dtype", dtype, "--shard-uds-path", f"/tmp/tgi-py-bench-{port}", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model to serve and compare with (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from launcher.prepare import prepare_default_model

    model_dir = args.model_dir or prepare_default_model()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [prompt_text(tokenizer, args.prompt_tokens, i) for i in range(args.requests)]
    server = None
    url = args.url
    if url is None:
        extra = ["--max-batch-prefill-tokens", "4096"]
        if args.model_dir is not None:
            extra += ["--model-id", str(args.model_dir)]
        server, url = start_server(args.dtype, extra)
    try:
        results = {"server": asyncio.run(load(url, prompts, args.concurrency, args.new_tokens,
                                              args.prompt_tokens))}
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    report = results["server"]
    print(f"tgi-py over HTTP: {args.requests} requests, concurrency {args.concurrency}, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.dtype}")
    print(f"  output tokens/s {report['output_tok_s']:.1f}")
    for name, key in (("time to first token", "ttft_s"), ("inter-token latency", "itl_s")):
        q = report[key]
        print(f"  {name:<20} p50 {q[50]:.4f}s  p90 {q[90]:.4f}s  p99 {q[99]:.4f}s")
    if not args.no_baseline:
        ids = [tokenizer.encode(p).ids[:args.prompt_tokens] for p in prompts]
        # batch 1 when measuring one stream, else one static batch of the same concurrency
        batch = args.concurrency
        static = transformers_baseline(model_dir, args.dtype, ids[:max(batch, 2)], args.new_tokens,
                                       batch)
        results["transformers"] = {"batch": batch, "tok_s": static}
        print("transformers generate, same weights and dtype, same run:")
        print(f"  static batch of {batch}: {static:.1f} tok/s  ->  tgi-py / transformers = "
              f"{report['output_tok_s'] / static:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
