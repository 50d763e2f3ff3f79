"""Embedding throughput against sentence-transformers, and how long embeddings stall a stream.

Throughput: texts of exactly --tokens tokens (special tokens included) sent to our /v1/embeddings
in requests of --batches texts each, --concurrency requests at a time, against
sentence-transformers' encode(batch_size=batch) on the same checkpoint in this process, in the
same run (--rounds alternated rounds, the best of each); texts/s for each, and the ratio.

Stall: a second model that generates (--stall-model, started on the same server with Jan's
`embedding: true`) streams tokens alone, then while batches of embeddings of that same model run
beside it; each stream's inter-token gaps (one decode step a call: --max-decode-steps-per-call 1),
mean and max, and the max against the mean alone.

    python benchmarks/embedding_bench.py                       # all-MiniLM-L6-v2, batches 1,32,256
    python benchmarks/embedding_bench.py --batches 32 --rounds 2 --no-stall
    python benchmarks/embedding_bench.py --no-stall -- --quantize int8   # launcher flags after --

Launcher flags after `--` apply to the whole server, the stall model's shards included.
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
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.http_bench import token_stamps, wait_until_ready  # noqa: E402

WORDS = ("the lighthouse keeper walked along the shore counting waves and gulls while the tide "
         "rose slowly over the rocks near an old harbour").split()


def texts_of(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` different texts of exactly `tokens` tokens each (special tokens included)."""
    out = []
    for variant in range(count):
        words = [WORDS[(variant * 7 + i) % len(WORDS)] for i in range(tokens)]
        words.insert(0, str(variant))
        while len(tokenizer.encode(" ".join(words)).ids) > tokens:
            words.pop()
        while len(tokenizer.encode(" ".join(words)).ids) < tokens:
            words.append("a")
        out.append(" ".join(words))
    return out


async def ours(url: str, model: str, texts: list[str], batch: int, concurrency: int) -> float:
    """texts/s of /v1/embeddings, `batch` texts a request, `concurrency` requests at a time."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    pending = list(batches)
    async with aiohttp.ClientSession() as session:
        async def worker():
            while pending:
                chunk = pending.pop()
                async with session.post(f"{url}/v1/embeddings",
                                        json={"model": model, "input": chunk}) as reply:
                    assert reply.status == 200, await reply.text()
                    await reply.read()

        await worker()  # warm: one request first
        pending.extend(batches)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sum(len(b) for b in batches) / (time.perf_counter() - started)


def theirs(model, texts: list[str], batch: int) -> float:
    """texts/s of sentence-transformers' encode, `batch` texts at a time."""
    model.encode(texts[:batch], batch_size=batch)  # warm
    started = time.perf_counter()
    model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - started)


async def stream_gaps(url: str, model: str, new_tokens: int) -> list[float]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": new_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        stamps, _ = await token_stamps(session, url, body, path="/v1/completions")
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def stall(url: str, model: str, texts: list[str], batch: int, new_tokens: int) -> dict:
    """The stream's gaps alone, then beside embeddings of `batch` texts sent back to back."""
    alone = await stream_gaps(url, model, new_tokens)
    stop = asyncio.Event()

    async def embed_forever():
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                async with session.post(f"{url}/v1/embeddings",
                                        json={"model": model, "input": texts[:batch]}) as reply:
                    assert reply.status == 200, await reply.text()
                    await reply.read()

    embedders = [asyncio.create_task(embed_forever()) for _ in range(2)]
    await asyncio.sleep(0.5)
    try:
        beside = await stream_gaps(url, model, new_tokens)
    finally:
        stop.set()
        await asyncio.gather(*embedders)
    # the mean, not the median: events that reach the client in one read are microseconds apart,
    # so that the median of a stream's gaps can fall far under a decode step
    mean = statistics.fmean(alone)
    return {"mean_gap_alone_ms": mean * 1e3, "max_gap_alone_ms": max(alone) * 1e3,
            "mean_gap_beside_ms": statistics.fmean(beside) * 1e3,
            "max_gap_beside_ms": max(beside) * 1e3, "max_beside_over_mean": max(beside) / mean}


def start_stall_model(url: str, name: str) -> str:
    """`name` pulled and started beside the embedding model, with Jan's `embedding: true`."""
    pulled = requests.post(f"{url}/v1/models/pull", json={"model": name}, timeout=30)
    assert pulled.status_code in (200, 409), pulled.text
    deadline = time.monotonic() + 900
    while requests.get(f"{url}/v1/models/{name}", timeout=10).json()["state"] != "downloaded":
        assert time.monotonic() < deadline, "the pull did not finish"
        time.sleep(1)
    patched = requests.patch(f"{url}/v1/models/{name}", json={"settings": {"embedding": True}},
                             timeout=10)
    assert patched.status_code == 200, patched.text
    started = requests.put(f"{url}/v1/models/{name}/start", timeout=900)
    assert started.json()["state"] == "running", started.text
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="all-minilm-l6-v2", help="short name or model directory")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--texts", type=int, default=512, help="texts per measurement")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; the best of each")
    p.add_argument("--dtype", default="", help="our shards' dtype (default: the machine's)")
    p.add_argument("--stall-model", default="smollm2-135m-instruct")
    p.add_argument("--stall-batch", type=int, default=32)
    p.add_argument("--stall-tokens", type=int, default=100, help="tokens the stream generates")
    p.add_argument("--no-stall", action="store_true")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("launcher_args", nargs="*", help="the launcher's own flags, after --")
    args = p.parse_args()
    from launcher.known_models import known_model
    from launcher.prepare import prepare_known_model
    from tokenizers import Tokenizer

    known = known_model(args.model)
    model_dir = prepare_known_model(known) if known is not None else Path(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = texts_of(tokenizer, args.texts, args.tokens)
    extra = ["--model-id", args.model, "--max-decode-steps-per-call", "1",
             "--model-registry-dir", f"/tmp/tgi-py-embedding-bench-{os.getpid()}"]
    process, url = start_server(extra + (["--dtype", args.dtype] if args.dtype else [])
                                + args.launcher_args)
    figures = {"model": args.model, "tokens": args.tokens, "concurrency": args.concurrency,
               "rounds": args.rounds, "launcher_args": args.launcher_args, "rows": []}
    try:
        served = requests.get(f"{url}/info", timeout=10).json()
        figures["dtype"] = served["model_dtype"]
        figures["quantization"] = served.get("quantization") or ""
        print(f"served: {served['model_dtype']}, quantization: "
              f"{figures['quantization'] or 'none'}", flush=True)
        from sentence_transformers import SentenceTransformer

        reference = SentenceTransformer(str(model_dir), device="cpu")
        for batch in [int(b) for b in args.batches.split(",")]:
            count = min(args.texts, max(batch * 4, 64))
            rate = baseline = 0.0
            # alternated, the best of each: other work on the machine slows one round or another
            for _ in range(args.rounds):
                rate = max(rate, asyncio.run(ours(url, served["model_id"], texts[:count], batch,
                                                  args.concurrency)))
                baseline = max(baseline, theirs(reference, texts[:count], batch))
            figures["rows"].append({"batch": batch, "ours_texts_per_s": rate,
                                    "sentence_transformers_texts_per_s": baseline,
                                    "ratio": rate / baseline})
            print(f"batch {batch:>4}: ours {rate:8.1f} texts/s   sentence-transformers "
                  f"{baseline:8.1f} texts/s   x{rate / baseline:.2f}", flush=True)
        if not args.no_stall:
            name = start_stall_model(url, args.stall_model)
            decoder = Tokenizer.from_file(str(Path(requests.get(
                f"{url}/v1/models/{name}", timeout=10).json()["assets"][0]) / "tokenizer.json"))
            stall_texts = texts_of(decoder, args.stall_batch, args.tokens)
            figures["stall"] = {"model": name, "batch": args.stall_batch, **asyncio.run(
                stall(url, name, stall_texts, args.stall_batch, args.stall_tokens))}
            s = figures["stall"]
            print(f"stall ({name}, embeddings of {args.stall_batch} x {args.tokens} tokens "
                  f"beside): inter-token gap mean {s['mean_gap_alone_ms']:.1f} ms alone, "
                  f"{s['mean_gap_beside_ms']:.1f} ms beside; max {s['max_gap_alone_ms']:.1f} "
                  f"ms alone, {s['max_gap_beside_ms']:.1f} ms beside "
                  f"({s['max_beside_over_mean']:.2f}x the mean alone)", flush=True)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


def start_server(extra: list[str]):
    """tgi-launcher with `extra` flags on a free port; (its process, its URL) once it serves."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher", "--port", str(port), "--hostname", "127.0.0.1",
         "--shard-uds-path", f"/tmp/tgi-py-bench-{port}", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, f"{url}/health", 600, "the server")
    return process, url


if __name__ == "__main__":
    main()
