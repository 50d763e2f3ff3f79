"""Inter-token latency of running streams while a long prompt arrives, with and without chunking.

16 streams decode; once every one of them is streaming, one 2,048-token prompt is sent, and the
streams' inter-token latencies from then on are measured. With chunked prefill
(--max-batch-prefill-tokens as the largest chunk; the router sizes each chunk to cost about one decode
step) the streams keep their pace; with the whole prompt prefilled at once they all stall for its
length. Same run, same machine.

    python benchmarks/chunked_prefill_bench.py [--streams 16] [--long-tokens 2048] [--chunk 512]
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

from benchmarks.engine_bench import percentile  # noqa: E402
from benchmarks.http_bench import one_request, prompt_text, start_server, token_stamps  # noqa: E402


async def scenario(url: str, streams: list[str], long_prompt: str, new_tokens: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one_request(session, url, streams[0], 4)  # warm-up
        all_decoding = asyncio.Event()
        first_tokens = []

        def on_first_token():
            first_tokens.append(time.perf_counter())
            if len(first_tokens) == len(streams):
                all_decoding.set()

        tasks = [asyncio.ensure_future(token_stamps(
            session, url, {"inputs": p, "parameters": {"max_new_tokens": new_tokens,
                                                       "ignore_eos": True}}, on_first_token))
                 for p in streams]
        await all_decoding.wait()  # every stream is decoding now
        window_start = time.perf_counter()
        ttft, _, _ = await one_request(session, url, long_prompt, 4)
        results = await asyncio.gather(*tasks)
    # inter-token gaps while all the streams decode: the streams' own admission (prompts prefilled
    # while earlier streams already decode) is not what this measures
    itls = [b - a for stamps, _ in results for a, b in zip(stamps, stamps[1:]) if a >= window_start]
    if not itls:
        raise RuntimeError("the streams ended before the long prompt arrived: raise --new-tokens")
    median = statistics.median(itls)
    p99 = percentile(itls, 99)
    return {"itl_median_s": median, "itl_p99_s": p99, "p99_over_median": p99 / median,
            "itl_max_s": max(itls), "long_prompt_ttft_s": ttft, "itl_count": len(itls)}


def run(prefill_tokens: int, args, streams, long_prompt) -> dict:
    total = args.long_tokens + args.new_tokens + 64
    extra = ["--max-batch-prefill-tokens", str(prefill_tokens), "--max-input-tokens",
             str(args.long_tokens + 32), "--max-total-tokens", str(total), "--prefix-caching", "off"]
    if args.model_dir is not None:
        extra += ["--model-id", str(args.model_dir)]
    server, url = start_server(args.dtype, extra)
    try:
        return asyncio.run(scenario(url, streams, long_prompt, args.new_tokens))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model to serve (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512,
                        help="--max-batch-prefill-tokens: the largest chunk")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from launcher.prepare import prepare_default_model

    model_dir = args.model_dir or prepare_default_model(dtype="float32")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    streams = [prompt_text(tokenizer, 128, i) for i in range(args.streams)]
    long_prompt = prompt_text(tokenizer, args.long_tokens, 99)
    figures = {"chunked": run(args.chunk, args, streams, long_prompt),
               "whole": run(args.long_tokens + 32, args, streams, long_prompt)}
    print(f"{args.streams} streams decoding, one {args.long_tokens}-token prompt arrives, "
          f"{args.dtype}")
    for name, label in (("chunked", f"chunks <= {args.chunk}"), ("whole", "prefilled at once")):
        f = figures[name]
        print(f"  {label:<18} inter-token median {f['itl_median_s'] * 1e3:6.1f} ms, p99 "
              f"{f['itl_p99_s'] * 1e3:7.1f} ms (p99 / median = {f['p99_over_median']:.2f}), "
              f"max {f['itl_max_s'] * 1e3:7.1f} ms; long prompt TTFT {f['long_prompt_ttft_s']:.2f}s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
