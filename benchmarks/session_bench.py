"""Time to first token of a request_id continuation (/api/generate-one) against a fresh request
whose prompt is the same history, for several history lengths, with one decode step for scale.

A continuation computes only the last generated token (its session kept the rest in KV blocks); a
fresh request computes the whole history. The server runs with the prefix cache off so that the
fresh request really does.

    python benchmarks/session_bench.py [--history-tokens 256,1024] [--repeats 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_bench import prompt_text, start_server  # noqa: E402

NEW_TOKENS = 8


async def timed_call(session: aiohttp.ClientSession, url: str, request_id: str, prompt: str
                     ) -> tuple[float, list[float], str, float]:
    """(seconds to the first chunk of text, gaps between later chunks, the text, whole seconds)."""
    body = {"request_id": request_id, "prompt": prompt, "generation_config": {
        "do_sample": False, "max_new_tokens": NEW_TOKENS}}
    start = time.perf_counter()
    stamps, text = [], []
    async with session.post(f"{url}/api/generate-one", json=body) as reply:
        reply.raise_for_status()
        async for chunk in reply.content.iter_any():
            if chunk:
                stamps.append(time.perf_counter())
                text.append(chunk.decode())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, "".join(text), time.perf_counter() - start


async def measure(url: str, history_tokens: list[int], repeats: int, tokenizer) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for length in history_tokens:
            prompt = prompt_text(tokenizer, length, 5)
            request_id = f"history-{length}"
            _, _, generated, _ = await timed_call(session, url, request_id, prompt)
            history = prompt + generated
            continued, fresh, steps, per_token = [], [], [], []
            for repeat in range(repeats):
                ttft, gaps, text, whole = await timed_call(session, url, request_id, "ignored")
                continued.append(ttft)
                steps += gaps
                per_token.append(whole / NEW_TOKENS)
                fresh_ttft, _, _, _ = await timed_call(session, url, f"fresh-{length}-{repeat}",
                                                       history)
                fresh.append(fresh_ttft)
                history += text
            row = {"history_tokens": length, "continuation_ttft_s": statistics.median(continued),
                   "fresh_ttft_s": statistics.median(fresh),
                   # a busy client can read a whole answer as one chunk: then a call's time per
                   # token (an upper bound on a step) stands in for the gaps between chunks
                   "decode_step_s": statistics.median(steps or per_token)}
            row["continuation_over_fresh"] = row["continuation_ttft_s"] / row["fresh_ttft_s"]
            row["continuation_over_step"] = row["continuation_ttft_s"] / row["decode_step_s"]
            rows.append(row)
            print(f"history {length:>5} tokens: continuation TTFT {row['continuation_ttft_s']:.3f}s"
                  f", fresh request TTFT {row['fresh_ttft_s']:.3f}s, one decode step "
                  f"{row['decode_step_s']:.3f}s  ->  continuation / fresh = "
                  f"{row['continuation_over_fresh']:.1%}, continuation / step = "
                  f"{row['continuation_over_step']:.1f}x", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model to serve (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--history-tokens", default="256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from launcher.prepare import prepare_default_model

    tokenizer = Tokenizer.from_file(str((args.model_dir or prepare_default_model())
                                        / "tokenizer.json"))
    lengths = [int(n) for n in args.history_tokens.split(",")]
    longest = max(lengths) + (args.repeats + 2) * NEW_TOKENS + 64
    extra = ["--prefix-caching", "off", "--max-input-tokens", str(longest),
             "--max-total-tokens", str(longest + NEW_TOKENS),
             "--max-batch-prefill-tokens", str(longest + NEW_TOKENS)]
    if args.model_dir is not None:
        extra += ["--model-id", str(args.model_dir)]
    server, url = start_server(args.dtype, extra)
    try:
        rows = asyncio.run(measure(url, lengths, args.repeats, tokenizer))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    print(f"{args.dtype}, {NEW_TOKENS} new tokens per call, prefix cache off, medians of "
          f"{args.repeats}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
