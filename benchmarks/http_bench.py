"""HTTP load benchmark: N streamed requests at concurrency C against tgi-py, then the same workload
against a peer server (--peer-url, any OpenAI-compatible server such as vLLM-CPU started with
../shared/peers/vllm-cpu.sh) and through `transformers`' generate (a static batch of C) on the same
weights and dtype, in the same run, with the ratios.

Every request has exactly --prompt-tokens prompt tokens and produces exactly --new-tokens tokens
(EOS ignored: `ignore_eos` on both APIs). Reports output tokens/s, time to first token and
inter-token latency percentiles, for each of our --routes (TGI's /generate_stream, OpenAI's
/v1/completions) and for the peer's /v1/completions.

    python benchmarks/http_bench.py --concurrency 32 --requests 64
    python benchmarks/http_bench.py --url http://127.0.0.1:8080 ...   # a server already running
    python benchmarks/http_bench.py --routes completions,generate_stream \
        --peer-url http://127.0.0.1:8102 --no-baseline
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
    """A text of exactly `length` tokens, different for each variant from its first token on (no
    two share a prefix the server could have cached)."""
    words, ids = [str(variant)], []
    index = variant
    while len(ids) < length:
        # a word is at least a token: as many words as tokens missing, then one encode (a
        # prompt of thousands of tokens in one or two), the text cut to `length` tokens
        for _ in range(length - len(ids)):
            words.append(WORDS[index % len(WORDS)])
            index += variant % 7 + 1
        ids = tokenizer.encode(" ".join(words)).ids
    return tokenizer.decode(ids[:length])


TOPICS = ("the water cycle", "photosynthesis", "how a bicycle works", "the history of the printing "
          "press", "why the sky is blue", "how vaccines train the immune system", "the rules of "
          "chess", "how a compiler works", "the causes of the French Revolution", "black holes",
          "how bread rises", "plate tectonics", "the life of honey bees", "how the internet "
          "routes packets", "the Roman aqueducts", "how to plan a vegetable garden")
FORMS = ("Explain {} to a curious ten-year-old.", "Write a short essay about {}.",
         "What are the most common misconceptions about {}?", "Describe {} step by step.")


def question(variant: int) -> str:
    """A natural question, different for each variant: prompts that, unlike prompt_text's, do
    not repeat themselves (what n-gram speculation finds in its lookups depends on it)."""
    topic, form = TOPICS[variant % len(TOPICS)], FORMS[variant // len(TOPICS) % len(FORMS)]
    text = form.format(topic)
    return text if variant < len(TOPICS) * len(FORMS) else f"({variant}) {text}"


async def speculation_counts(session, url: str) -> tuple[float, float] | None:
    """(draft tokens verified, accepted) so far, from the server's /metrics; None without them."""
    async with session.get(f"{url}/metrics") as reply:
        text = await reply.text()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("tgi_speculation_draft_tokens", "tgi_speculation_accepted_tokens"):
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values["tgi_speculation_draft_tokens"], values["tgi_speculation_accepted_tokens"]


async def token_stamps(session, url: str, body: dict, on_first_token=None, *,
                       path: str = "/generate_stream") -> tuple[list[float], int]:
    """Streams one request; returns when each event with text arrived, and the tokens generated
    (one per event on TGI's route; the usage of OpenAI's last chunk, as a server may send several
    tokens in one event)."""
    stamps, tokens = [], None
    async with session.post(f"{url}{path}", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{reply.status}: {await reply.text()}")
        async for line in reply.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            # every route's events are parsed, so that the client (on the same cores as the
            # server) spends alike on each and the routes compare on the server's cost
            event = json.loads(line[5:])
            if path == "/v1/completions":
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if not any(c.get("text") for c in event.get("choices") or []):
                    continue
            elif "token" not in event:  # TGI's error event
                raise RuntimeError(f"stream error: {event}")
            stamps.append(time.perf_counter())
            if len(stamps) == 1 and on_first_token is not None:
                on_first_token()
    return stamps, len(stamps) if tokens is None else tokens


def cut_to_layers(model_dir: Path, layers: int, parent: Path = Path("/tmp")) -> Path:
    """A model directory serving `model_dir`'s first `layers` layers (the shard loads the layers
    config.json names and leaves the other weights unread)."""
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: the model has {config['num_hidden_layers']}")
    cut = parent / f"http-bench-{model_dir.name}-{layers}-layers"
    cut.mkdir(exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "config.json" and not (cut / item.name).exists():
            (cut / item.name).symlink_to(item.resolve())
    (cut / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return cut


def request_body(route: str, prompt: str, new_tokens: int, prompt_tokens: int | None,
                 model: str) -> tuple[str, dict]:
    """The path and body of one request that makes exactly `new_tokens` tokens."""
    if route == "completions":
        return "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
            "min_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    parameters = {"max_new_tokens": new_tokens, "ignore_eos": True}
    if prompt_tokens is not None:
        parameters["truncate"] = prompt_tokens
    return "/generate_stream", {"inputs": prompt, "parameters": parameters}


async def timed_request(session, url: str, prompt: str, new_tokens: int,
                        prompt_tokens: int | None = None, *, route: str = "generate_stream",
                        model: str = "tgi-py") -> tuple[float, list[float], int]:
    """One streamed request: when it was sent, when each event with text came, its tokens."""
    path, body = request_body(route, prompt, new_tokens, prompt_tokens, model)
    started = time.perf_counter()
    stamps, tokens = await token_stamps(session, url, body, path=path)
    if not stamps:  # the workload asks for exactly new_tokens: a server that sent none failed it
        raise RuntimeError(f"{url}{path} streamed no text for a request of {new_tokens} tokens")
    return started, stamps, tokens


async def one_request(session, url: str, prompt: str, new_tokens: int,
                      prompt_tokens: int | None = None, *, route: str = "generate_stream",
                      model: str = "tgi-py"):
    """(time to first token, the gaps between tokens, tokens) of one streamed request."""
    started, stamps, tokens = await timed_request(session, url, prompt, new_tokens, prompt_tokens,
                                                  route=route, model=model)
    return stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])], tokens


def all_decoding_rate(stamps: list[list[float]]) -> float | None:
    """Tokens/s while every request of a wave was past its first token and none had ended.

    What the decode steps of the whole batch deliver, without the prompts' prefills (which a
    wave's own tokens/s counts); None when no such time was long enough to measure."""
    begin, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if end - begin < 0.05:
        return None
    tokens = sum(1 for s in stamps for t in s if begin < t <= end)
    return tokens / (end - begin)


async def load(url: str, prompts: list[str], concurrency: int, new_tokens: int,
               prompt_tokens: int, *, route: str = "generate_stream", model: str = "tgi-py",
               warm_up: str | None = None, warm: bool = True) -> dict:
    """`warm`: one request (`warm_up`, else the first prompt) before the timed ones."""
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    # a connection per request: llama-server closes idle keep-alive connections, which aiohttp
    # then fails to write to; every server gets the same, and a loopback connect costs little
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def bounded(prompt):
            async with semaphore:
                return await timed_request(session, url, prompt, new_tokens, prompt_tokens,
                                           route=route, model=model)

        if warm:
            await bounded(warm_up or prompts[0])
        before = await speculation_counts(session, url)
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - started
        after = await speculation_counts(session, url)
    tokens = sum(r[2] for r in results)
    ttfts = [r[1][0] - r[0] for r in results]
    gaps = [[b - a for a, b in zip(r[1], r[1][1:])] for r in results]
    itls = [x for g in gaps for x in g]
    # time per output token after the first, per request, as vLLM's benchmark reports it
    tpots = [sum(g) / (r[2] - 1) for g, r in zip(gaps, results) if r[2] > 1]
    return {"route": route, "requests": len(prompts), "concurrency": concurrency, "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_s": {q: percentile(ttfts, q) for q in (50, 90, 99)},
            "itl_s": {q: percentile(itls, q) for q in (50, 90, 99)},
            "tpot_s": percentile(tpots, 50) if tpots else 0.0,
            "all_decoding_tok_s": (all_decoding_rate([r[1] for r in results])
                                   if concurrency >= len(prompts) else None),
            # in the prompts' order: the first `concurrency` arrived together (a wave)
            "request_ttft_s": ttfts,
            "speculation": None if before is None or after is None else {
                "draft_tokens": after[0] - before[0], "accepted_tokens": after[1] - before[1]}}


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
    wait_until_ready(process, f"{url}/health", 600, "the server")
    return process, url


def wait_until_ready(process: subprocess.Popen, probe_url: str, timeout: float, what: str) -> None:
    """Until `probe_url` answers 200; an exit or the timeout is an error (the process is stopped)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up")
        try:
            with urllib.request.urlopen(probe_url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)
    raise RuntimeError(f"{what} did not start")


ROUTES = ("generate_stream", "completions")


def wait_until_closed(url: str, timeout: float) -> None:
    """Until nothing listens at `url` any more, or `timeout` seconds.

    A peer command run by a shell leaves its server shutting down after the shell has gone."""
    host, port = url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return
        time.sleep(0.1)


def start_peer(command: str, url: str, *, timeout: float = 900, log: Path | None = None,
               env: dict | None = None) -> subprocess.Popen:
    """`log`: a file for the peer's output (default: dropped); `env`: its environment."""
    output = open(log, "wb") if log is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(command, shell=True, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
    finally:
        if log is not None:
            output.close()
    # a first start may build the peer's environment
    wait_until_ready(process, f"{url.rstrip('/')}/v1/models", timeout, f"the peer ({command})")
    return process


def print_row(name: str, report: dict) -> None:
    ttft, itl = report["ttft_s"], report["itl_s"]
    print(f"  {name:<34} {report['output_tok_s']:>8.1f} tok/s   TTFT p50 {ttft[50] * 1e3:7.1f} ms"
          f"   ITL p50 {itl[50] * 1e3:6.1f} ms  p99 {itl[99] * 1e3:6.1f} ms   TPOT "
          f"{report['tpot_s'] * 1e3:6.1f} ms")


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
    parser.add_argument("--prompts", default="words", choices=["words", "questions"],
                        help="words: texts of exactly --prompt-tokens tokens cycling through a "
                             "few words (they repeat themselves); questions: short natural "
                             "questions (as many tokens as they take)")
    parser.add_argument("--routes", default="generate_stream",
                        help=f"our routes to measure, comma-separated, of {', '.join(ROUTES)}")
    parser.add_argument("--peer-url", default=None,
                        help="an OpenAI-compatible server given the same workload after ours")
    parser.add_argument("--peer-model", default="peer", help="the model name the peer serves")
    parser.add_argument("--peer-command", default=None,
                        help="a shell command that starts the peer at --peer-url once our "
                             "server has stopped (so that neither idles beside the other's run: "
                             "vLLM's workers poll the CPU while idle); stopped at the end")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra launcher argument for the server started here (repeatable)")
    parser.add_argument("--layers", type=int, default=None,
                        help="serve the model cut to its first N layers (a directory beside it "
                             "in /tmp: its files linked, config.json's num_hidden_layers "
                             "changed): a token then costs the shard little, and the routes "
                             "compare on the router's own cost")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.peer_command and not args.peer_url:
        parser.error("--peer-command needs --peer-url (where the peer it starts listens)")
    routes = args.routes.split(",")
    if any(r not in ROUTES for r in routes):
        parser.error(f"--routes takes {', '.join(ROUTES)}")
    from tokenizers import Tokenizer

    from launcher.prepare import prepare_default_model

    model_dir = args.model_dir or prepare_default_model(dtype="float32")
    if args.layers is not None:
        model_dir = cut_to_layers(model_dir, args.layers)
        args.model_dir = model_dir  # the server below serves the cut model
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    def prompt_set(index: int) -> list[str]:
        """Each of our routes gets prompts of its own: a second route must not find the first
        one's prompts in the prefix cache. The peer, a fresh server, gets the first route's."""
        variants = range(index * args.requests, (index + 1) * args.requests)
        if args.prompts == "questions":
            return [question(v) for v in variants]
        return [prompt_text(tokenizer, args.prompt_tokens, v) for v in variants]

    prompts = prompt_set(0)
    warm_up = prompt_text(tokenizer, args.prompt_tokens, 10**6)
    # a question's tokens are its own: none is cut to --prompt-tokens
    truncate = args.prompt_tokens if args.prompts == "words" else None
    server = None
    url = args.url
    if url is None:
        extra = ["--max-batch-prefill-tokens", "4096", *args.server_arg]
        if args.model_dir is not None:
            extra += ["--model-id", str(args.model_dir)]
        server, url = start_server(args.dtype, extra)
    results = {}
    try:
        for index, route in enumerate(routes):
            results[route] = asyncio.run(load(url, prompt_set(index), args.concurrency,
                                              args.new_tokens, truncate, route=route,
                                              warm_up=warm_up))
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    if args.peer_url:
        peer = start_peer(args.peer_command, args.peer_url) if args.peer_command else None
        try:
            # the peer's tokenizer may count our prompts differently: no truncation to rely on
            results["peer"] = asyncio.run(load(args.peer_url.rstrip("/"), prompts,
                                               args.concurrency, args.new_tokens, None,
                                               route="completions", model=args.peer_model,
                                               warm_up=warm_up))
        finally:
            if peer is not None:
                os.killpg(peer.pid, signal.SIGTERM)
                peer.wait(timeout=120)
                wait_until_closed(args.peer_url, 120)
    results["server"] = results[routes[0]]
    prompt_shape = (f"{args.prompt_tokens} prompt" if args.prompts == "words"
                     else "question prompts")
    print(f"{args.requests} requests, concurrency {args.concurrency}, {prompt_shape} + "
          f"{args.new_tokens} new tokens, {args.dtype}, greedy, EOS ignored")
    for route in routes:
        print_row(f"tgi-py {'/' + route if route == 'generate_stream' else '/v1/' + route}",
                  results[route])
        speculation = results[route]["speculation"]
        if speculation and speculation["draft_tokens"]:
            drafted, accepted = speculation["draft_tokens"], speculation["accepted_tokens"]
            print(f"    speculation: {accepted:.0f} of {drafted:.0f} draft tokens accepted "
                  f"({accepted / drafted:.0%}), {accepted / results[route]['output_tokens']:.0%} "
                  "of the output")
    if "peer" in results:
        print_row(f"peer {args.peer_url} /v1/completions", results["peer"])
        peer = results["peer"]["output_tok_s"]
        for route in routes:
            ours = results[route]["output_tok_s"]
            print(f"  tgi-py {route} / peer = {ours / peer:.2f}x output tokens/s")
    if not args.no_baseline:
        ids = [tokenizer.encode(p).ids[:args.prompt_tokens] for p in prompts]
        # a static batch of the same concurrency
        batch = args.concurrency
        static = transformers_baseline(model_dir, args.dtype, ids[:max(batch, 2)], args.new_tokens,
                                       batch)
        results["transformers"] = {"batch": batch, "tok_s": static}
        print("transformers generate, same weights and dtype, same run:")
        print(f"  static batch of {batch}: {static:.1f} tok/s  ->  tgi-py / transformers = "
              f"{results['server']['output_tok_s'] / static:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
