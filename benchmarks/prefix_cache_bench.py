"""Time to first token with a shared system prompt: the first request computes it, later ones reuse
its KV blocks. Runs the server with the prefix cache on, then off, in the same run.

    python benchmarks/prefix_cache_bench.py [--shared-tokens 1024] [--later 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.http_bench import one_request, prompt_text, start_server  # noqa: E402


async def ttfts(url: str, shared: str, questions: list[str]) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        out = []
        for question in questions:  # one after another: each later request finds the prefix
            prompt = shared + question
            ttft, _, _ = await one_request(session, url, prompt, 4)
            out.append(ttft)
        return out


def run(mode: str, args, shared: str, questions: list[str]) -> list[float]:
    longest = args.shared_tokens + 64
    extra = ["--prefix-caching", mode, "--max-input-tokens", str(longest), "--max-total-tokens",
             str(longest + 8), "--max-batch-prefill-tokens", str(longest + 8)]
    if args.model_dir is not None:
        extra += ["--model-id", str(args.model_dir)]
    server, url = start_server(args.dtype, extra)
    try:
        return asyncio.run(ttfts(url, shared, questions))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model to serve (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--later", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from launcher.prepare import prepare_default_model

    tokenizer = Tokenizer.from_file(str((args.model_dir or prepare_default_model())
                                        / "tokenizer.json"))
    shared = prompt_text(tokenizer, args.shared_tokens, 3)
    questions = [f"\nQuestion {i}: what happened on day {i}?\nAnswer:" for i in range(args.later + 1)]
    figures = {}
    for mode in ("on", "off"):
        times = run(mode, args, shared, questions)
        later = statistics.median(times[1:])
        figures[mode] = {"first_ttft_s": times[0], "later_ttft_median_s": later,
                         "later_over_first": later / times[0]}
        print(f"prefix cache {mode:>3}: first request TTFT {times[0]:.3f}s, later requests median "
              f"{later:.3f}s  ->  later / first = {later / times[0]:.1%}")
    print(f"with a {args.shared_tokens}-token shared prompt, {args.dtype}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
