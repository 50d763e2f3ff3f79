"""Soak test: every API under mixed load, with client disconnects and malformed requests.

Runs for --minutes, tallies each outcome by kind, follows the RSS of the router and the shards, and
checks at the end that no KV block leaked. Exits 1 on any unexpected outcome or leaked block. A
shard's RSS also grows as its KV pool's blocks are first written (on the CPU the pool is mapped,
not written, at start), up to the pool's size: growth is a leak only past that.

Starts `tgi-launcher` (flags after `--` go to it) or attaches to a running one (Linux: RSS is read
from /proc, the router and shards being the launcher's children).

    python benchmarks/soak.py --minutes 10 --concurrency 16 [-- --max-batch-prefill-tokens 4096]
    python benchmarks/soak.py --url http://127.0.0.1:8080 --launcher-pid 1234 --rate 12
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.http_bench import WORDS  # noqa: E402

# (path, API family, stream: True/False, or None for "the body says")
ROUTES = [("/generate", "tgi", False), ("/generate_stream", "tgi", True), ("/", "tgi", None),
          ("/v1/chat/completions", "openai", None), ("/v1/completions", "openai", None)]
MALFORMED = ("invalid_json", "wrong_type", "huge_int", "negative_max_tokens", "nested_json", "nan",
             "unknown_route", "empty_body")
EXPECTED = ("ok", "expected_4xx", "overloaded_429", "disconnected")
UNEXPECTED = ("5xx", "4xx_well_formed", "accepted_malformed", "bad_error_body", "connection_error",
              "timeout", "bad_body", "stream_no_final", "stream_error_event")


@dataclass(slots=True)
class Call:
    path: str
    family: str  # "tgi" or "openai": which error shapes are right
    is_stream: bool
    body: bytes
    label: str  # what the report names the request by
    is_malformed: bool = False
    disconnect_after_events: int | None = None  # streams: close after this many events
    cancel_after_s: float | None = None  # non-streaming: give up after this long


@dataclass(slots=True)
class Outcome:
    kind: str
    tokens: int = 0
    detail: str = ""
    error_shape: str | None = None  # "tgi" or "openai", for expected 4xx


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    unexpected_by_request: Counter = field(default_factory=Counter)
    error_shapes: Counter = field(default_factory=Counter)  # "family route -> shape" for 4xx
    examples: dict[str, list[str]] = field(default_factory=dict)
    tokens: int = 0

    def add(self, call: Call, outcome: Outcome) -> None:
        self.counts[outcome.kind] += 1
        self.tokens += outcome.tokens
        if outcome.error_shape:
            self.error_shapes[f"{call.family} routes -> {outcome.error_shape} shape"] += 1
        if outcome.kind in UNEXPECTED:
            self.unexpected_by_request[f"{outcome.kind} <- {call.label}"] += 1
            seen = self.examples.setdefault(outcome.kind, [])
            if len(seen) < 3:
                seen.append(f"{call.label}: {outcome.detail[:160]}")
            if self.num_unexpected <= 20:  # as it happens: a long run's log shows when
                print(f"[{time.strftime('%H:%M:%S')}] unexpected {outcome.kind} <- {call.label}: "
                      f"{outcome.detail[:160]}", flush=True)

    @property
    def num_unexpected(self) -> int:
        return sum(self.counts[k] for k in UNEXPECTED)

    def figures(self, wall_s: float) -> dict:
        total = sum(self.counts.values())
        return {"requests": total, "requests_per_s": total / wall_s, "tokens": self.tokens,
                "tokens_per_s": self.tokens / wall_s, "unexpected": self.num_unexpected,
                "outcomes": dict(self.counts), "error_shapes": dict(self.error_shapes),
                "unexpected_by_request": dict(self.unexpected_by_request),
                "examples": self.examples}


# ---- requests -----------------------------------------------------------------------------------

def good_body(path: str, is_stream: bool, rng: random.Random, max_new_tokens: int) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 16)))
    n = rng.randint(1, max_new_tokens)
    if path == "/v1/chat/completions":
        body = {"model": "tgi", "messages": [{"role": "user", "content": prompt}], "max_tokens": n}
    elif path == "/v1/completions":
        body = {"model": "tgi", "prompt": prompt, "max_tokens": n}
    else:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
    sampling = {"temperature": 0.8, "seed": rng.randrange(2**31)} if rng.random() < 0.5 else {}
    if "parameters" in body:
        body["parameters"].update(sampling, do_sample=bool(sampling))
    else:
        body.update(sampling or {"temperature": 0})
    if path != "/generate" and path != "/generate_stream":
        body["stream"] = is_stream
    return body


def _set(body: dict, tgi_name: str, openai_name: str, value) -> dict:
    body = json.loads(json.dumps(body))
    if "parameters" in body:
        body["parameters"][tgi_name] = value
    else:
        body[openai_name] = value
    return body


def malformed_body(kind: str, body: dict) -> bytes:
    if kind == "invalid_json":
        return json.dumps(body).encode()[:-7]
    if kind == "empty_body":
        return b""
    if kind == "nested_json":  # 5,000 arrays deep where the prompt goes
        key = next(k for k in ("inputs", "messages", "prompt") if k in body)
        text = json.dumps({**body, key: "@"})
        return text.replace('"@"', "[" * 5000 + "]" * 5000).encode()
    changed = {"wrong_type": lambda b: _set(b, "max_new_tokens", "max_tokens", "ten"),
               "huge_int": lambda b: _set(b, "top_k", "max_tokens", 2**40),
               "negative_max_tokens": lambda b: _set(b, "max_new_tokens", "max_tokens", -5),
               "nan": lambda b: _set(b, "temperature", "temperature", float("nan")),
               "unknown_route": lambda b: b}[kind](body)
    return json.dumps(changed).encode()  # NaN is written as the bare literal


def next_call(rng: random.Random, args) -> Call:
    path, family, is_stream = rng.choice(ROUTES)
    is_stream = rng.random() < 0.5 if is_stream is None else is_stream
    body = good_body(path, is_stream, rng, args.max_new_tokens)
    label = path + (" stream" if is_stream else "")
    roll = rng.random()
    if roll < args.malformed and args.malformed_kinds:
        kind = rng.choice(args.malformed_kinds)
        if kind == "unknown_route":
            path, family = "/v1/no_such_route", "tgi"
        return Call(path, family, is_stream, malformed_body(kind, body), f"{kind} {label}",
                    is_malformed=True)
    call = Call(path, family, is_stream, json.dumps(body).encode(), label)
    if roll < args.malformed + args.disconnects:
        call.label += " disconnect"
        if is_stream:
            call.disconnect_after_events = rng.randint(1, 2)
        else:
            call.cancel_after_s = rng.uniform(0.01, 0.5)
    return call


# ---- outcomes -----------------------------------------------------------------------------------

def error_shape(text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), str) and "error_type" in body:
        return "tgi"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return "openai"
    return None


def classify_error(call: Call, status: int, text: str) -> Outcome:
    detail = f"{status} {text[:200]}"
    if status == 429:
        return Outcome("overloaded_429")
    if status >= 500:
        return Outcome("5xx", detail=detail)
    if not call.is_malformed:
        return Outcome("4xx_well_formed", detail=detail)
    shape = error_shape(text)
    if shape is None or (call.family == "tgi" and shape != "tgi"):
        return Outcome("bad_error_body", detail=detail)
    return Outcome("expected_4xx", error_shape=shape)


def body_tokens(path: str, body) -> int | None:
    """Generated tokens in a well-formed non-streaming answer; None when it is not well formed."""
    try:
        if path == "/":
            body = body[0] if isinstance(body, list) and len(body) == 1 else None
        if path in ("/", "/generate"):
            return body["details"]["generated_tokens"] if isinstance(body["generated_text"],
                                                                     str) else None
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return body["usage"]["completion_tokens"] if isinstance(text, str) else None
    except (KeyError, IndexError, TypeError):
        return None


def stream_outcome(call: Call, events: list[str]) -> Outcome:
    try:
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
    except ValueError as err:
        return Outcome("bad_body", detail=f"event not JSON: {err}")
    if not all(isinstance(p, dict) for p in payloads):
        return Outcome("bad_body", detail="event not an object")
    errors = [p for p in payloads if "error" in p]
    if errors:
        return Outcome("stream_error_event", detail=json.dumps(errors[0]))
    if call.family == "openai":
        chunks = [p for p in payloads if p.get("choices")]
        finished = any(c.get("finish_reason") for p in chunks for c in p["choices"])
        if not (events and events[-1] == "[DONE]" and finished):
            return Outcome("stream_no_final", detail=f"{len(events)} events, last {events[-1:]}")
        return Outcome("ok", tokens=len(chunks))
    if not payloads or not isinstance(payloads[-1].get("generated_text"), str):
        return Outcome("stream_no_final", detail=f"{len(events)} events, last {events[-1:]}")
    return Outcome("ok", tokens=len(payloads))


async def send(session: aiohttp.ClientSession, url: str, call: Call) -> Outcome:
    headers = {"Content-Type": "application/json"}
    async with session.post(url + call.path, data=call.body, headers=headers) as reply:
        if reply.status != 200:
            return classify_error(call, reply.status, await reply.text())
        if call.is_malformed:
            await reply.read()
            return Outcome("accepted_malformed", detail="200")
        if reply.content_type == "text/event-stream":
            events = []
            async for line in reply.content:
                if line.startswith(b"data:"):
                    events.append(line[5:].strip().decode())
                    if len(events) == call.disconnect_after_events:
                        reply.close()
                        return Outcome("disconnected")
            return stream_outcome(call, events)
        text = await reply.text()
        tokens = None if call.is_stream else body_tokens(call.path, json.loads(text))
        if tokens is None:
            return Outcome("bad_body", detail=f"{reply.content_type} {text[:200]}")
        return Outcome("ok", tokens=tokens)


async def attempt(session: aiohttp.ClientSession, url: str, call: Call,
                  timeout_s: float) -> Outcome:
    try:
        return await asyncio.wait_for(send(session, url, call), call.cancel_after_s or timeout_s)
    except asyncio.TimeoutError:
        if call.cancel_after_s:
            return Outcome("disconnected")
        return Outcome("timeout", detail=f"no answer in {timeout_s}s")
    except (aiohttp.ClientError, ValueError) as err:  # ValueError: a 200 body that is not JSON
        kind = "bad_body" if isinstance(err, ValueError) else "connection_error"
        return Outcome(kind, detail=f"{type(err).__name__}: {err}")


# ---- server processes and metrics ---------------------------------------------------------------

def server_processes(launcher_pid: int) -> dict[str, int]:
    """name -> pid of the launcher's children: "router", "shard0", "shard1", ..."""
    names = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if b"router" in argv:
            names["router"] = int(stat.parent.name)
        elif b"shard" in argv:
            rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "?")
            names[f"shard{rank}"] = int(stat.parent.name)
    return dict(sorted(names.items()))


def rss_mib(pid: int) -> float | None:
    """Resident memory of a live process; None once it has exited (a zombie has no VmRSS)."""
    try:
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


async def kv_blocks(session: aiohttp.ClientSession, url: str, wait_s: float) -> dict:
    """The KV gauges once the load has stopped, polled up to `wait_s` for releases to land.
    leaked = total - free - held by the prefix cache; None when /metrics cannot be read."""
    names = {"total": "tgi_kv_cache_total_blocks", "free": "tgi_kv_cache_free_blocks",
             "prefix_cache": "tgi_kv_cache_prefix_blocks"}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            async with session.get(f"{url}/metrics") as reply:
                text = await reply.text()
        except aiohttp.ClientError as err:
            return {"leaked": None, "error": f"/metrics: {type(err).__name__}: {err}"}
        values = {}
        for key, name in names.items():
            match = re.search(rf"^{name} (\S+)$", text, re.M)
            if match is None and key != "prefix_cache":  # unmeasured is not "nothing leaked"
                return {"leaked": None, "error": f"/metrics has no {name}"}
            values[key] = int(float(match.group(1))) if match else 0
        values["leaked"] = values["total"] - values["free"] - values["prefix_cache"]
        if values["leaked"] == 0 or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.5)


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class Run:
    args: argparse.Namespace
    url: str
    processes: dict[str, int]  # name -> pid; empty when attached without --launcher-pid
    tally: Tally = field(default_factory=Tally)
    rss: list[dict] = field(default_factory=list)  # {"t_s": seconds, name: MiB or None}
    started: float = field(default_factory=time.monotonic)
    is_stopping: bool = False

    def is_server_gone(self) -> bool:
        """The router, which serves HTTP, has exited (False when its pid is unknown)."""
        return "router" in self.processes and rss_mib(self.processes["router"]) is None

    def report(self, label: str = "") -> None:
        t = time.monotonic() - self.started
        row = {"t_s": round(t, 1), **{n: rss_mib(p) for n, p in self.processes.items()}}
        self.rss.append(row)
        mib = "  ".join(f"{n} {v:.1f}" if v else f"{n} GONE" for n, v in row.items() if n != "t_s")
        print(f"[{t:6.0f}s] rss MiB: {mib or 'n/a'} | {sum(self.tally.counts.values())} requests, "
              f"{self.tally.num_unexpected} unexpected {label}", flush=True)


async def load(run: Run, session: aiohttp.ClientSession, seconds: float) -> None:
    args = run.args
    rng = random.Random(args.seed)
    deadline = time.monotonic() + seconds

    def is_running() -> bool:
        return time.monotonic() < deadline and not run.is_stopping

    async def one() -> str:
        call = next_call(rng, args)
        outcome = await attempt(session, run.url, call, args.request_timeout)
        run.tally.add(call, outcome)
        if outcome.kind == "connection_error" and run.is_server_gone():
            run.is_stopping = True  # every further request would fail the same way
        return outcome.kind

    async def worker() -> None:
        while is_running():
            if await one() == "overloaded_429":
                await asyncio.sleep(rng.uniform(0.05, 0.25))  # back off, as a polite client does

    if args.rate is None:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return
    in_flight = set()  # open loop: Poisson arrivals at --rate, however many are still in flight
    while is_running():
        task = asyncio.ensure_future(one())
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*in_flight)


async def soak(run: Run) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        run.report("(start)")
        loading = asyncio.ensure_future(load(run, session, run.args.minutes * 60))
        while not loading.done():
            await asyncio.wait([loading], timeout=run.args.report_every)
            if not loading.done():
                run.report()
        await loading
        wall = time.monotonic() - run.started
        kv = await kv_blocks(session, run.url, run.args.idle_seconds)
    run.report("(end, after idle)")
    return {"wall_s": wall, "kv_blocks": kv}


def rss_growth(rss: list[dict], warmup_s: float) -> tuple[dict, float | None]:
    """% growth per process from the first report at or after warm-up to the last one."""
    base = next((r for r in rss[:-1] if r["t_s"] >= warmup_s), None)
    if base is None:
        return {}, None
    return {n: (rss[-1][n] / v - 1) * 100 for n, v in base.items()
            if n != "t_s" and v and rss[-1].get(n)}, base["t_s"]


def print_report(run: Run, f: dict) -> None:
    tally = run.tally
    print(f"\noutcomes: {f['requests']} requests in {f['wall_s']:.0f}s, "
          f"{f['requests_per_s']:.1f} requests/s, {f['tokens_per_s']:.1f} tokens/s")
    for kind in EXPECTED:
        print(f"  {kind:<20} {tally.counts[kind]:6d}")
    for shape, count in sorted(tally.error_shapes.items()):
        print(f"    4xx error shape: {shape}: {count}")
    print(f"unexpected: {tally.num_unexpected}")
    for kind in (k for k in UNEXPECTED if tally.counts[k]):
        print(f"  {kind:<20} {tally.counts[kind]:6d}   e.g. {tally.examples[kind][0]}")
    by_request = tally.unexpected_by_request.most_common()
    for key, count in by_request[:20]:
        print(f"    {count:5d} x {key}")
    if len(by_request) > 20:
        print(f"    ... and {len(by_request) - 20} more kinds of request (all in --json-out)")
    growth = "  ".join(f"{n} {g:+.1f}%" for n, g in f["rss_growth_percent"].items())
    print(f"rss growth from t={f['rss_growth_from_s']}s to the end: {growth or 'n/a'}")
    kv = f["kv_blocks"]
    print(f"kv blocks at idle: {kv['error']}" if "error" in kv else
          f"kv blocks at idle: total {kv['total']}, free {kv['free']}, prefix cache "
          f"{kv['prefix_cache']} -> leaked {kv['leaked']}")
    if not f["is_server_alive"]:
        print("the server died during the soak" + (f"; see {f['server_log']}"
                                                    if f["server_log"] else ""))


def start_launcher(args, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    log_path = Path(tempfile.mkstemp(prefix="tgi-py-soak-", suffix=".log")[1])
    model = ["--model-id", str(args.model_dir)] if args.model_dir else []
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "launcher", *model, "--port", str(ports[0]), "--hostname",
             "127.0.0.1", "--dtype", args.dtype, "--shard-uds-path", f"/tmp/tgi-py-soak-{ports[0]}",
             "--master-port", str(ports[1]), *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports[0]}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited during start-up; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return process, url, log_path
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not start; see {log_path}")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Flags after `--` go to tgi-launcher.")
    p.add_argument("--url", help="a running server (default: start tgi-launcher)")
    p.add_argument("--launcher-pid", type=int, help="with --url: its launcher, for RSS figures")
    p.add_argument("--model-dir", type=Path, help="model to serve (default: the launcher's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16,
                   help="closed-loop workers (each backs off briefly after a 429)")
    p.add_argument("--rate", type=float, help="open loop instead: requests/s, Poisson arrivals")
    p.add_argument("--max-new-tokens", type=int, default=16, help="drawn from 1..this")
    p.add_argument("--disconnects", type=float, default=0.1, help="fraction we abandon")
    p.add_argument("--malformed", type=float, default=0.1, help="fraction that are malformed")
    p.add_argument("--malformed-kinds", default=",".join(MALFORMED),
                   help="comma-separated subset of: " + ", ".join(MALFORMED))
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds, else a hang")
    p.add_argument("--report-every", type=float, default=60.0, help="seconds between RSS lines")
    p.add_argument("--warmup-seconds", type=float, help="RSS growth is measured from the first "
                   "report after this (default: 60, or a fifth of shorter runs)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="wait for KV blocks to return")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="write every figure here")
    args = p.parse_args(argv[:split])
    args.malformed_kinds = [k for k in args.malformed_kinds.split(",") if k]
    if unknown := set(args.malformed_kinds) - set(MALFORMED):
        p.error(f"unknown --malformed-kinds {sorted(unknown)}; choose from {MALFORMED}")
    if args.warmup_seconds is None:
        args.warmup_seconds = min(60.0, args.minutes * 60 / 5)
    return args, argv[split + 1:]


def main() -> int:
    args, extra = parse_args()
    server, url, log_path = None, args.url, None
    if url is None:
        server, url, log_path = start_launcher(args, extra)
        print(f"server {url}, launcher pid {server.pid}, log {log_path}")
    launcher_pid = server.pid if server else args.launcher_pid
    run = Run(args, url.rstrip("/"), server_processes(launcher_pid) if launcher_pid else {})
    mode = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"soak {args.minutes} min, {mode}, {args.disconnects:.0%} disconnects, "
          f"{args.malformed:.0%} malformed, max_new_tokens <= {args.max_new_tokens}, "
          f"processes {run.processes or 'unknown (no --launcher-pid)'}", flush=True)
    try:
        f = asyncio.run(soak(run))
        f["is_server_alive"] = not run.is_server_gone() and (not server or server.poll() is None)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    growth, base_t = rss_growth(run.rss, args.warmup_seconds)
    f.update(run.tally.figures(f["wall_s"]), rss_mib=run.rss, rss_growth_percent=growth,
             rss_growth_from_s=base_t, server_log=log_path and str(log_path),
             launcher_flags=extra, config={k: v if isinstance(v, (int, float, list)) else str(v)
                                           for k, v in vars(args).items()})
    print_report(run, f)
    leaked = f["kv_blocks"]["leaked"]
    passed = f["unexpected"] == 0 and leaked == 0 and f["is_server_alive"]
    print(f"SOAK {'PASS' if passed else 'FAIL'}: {f['unexpected']} unexpected, "
          f"{'?' if leaked is None else leaked} leaked blocks, server "
          f"{'alive' if f['is_server_alive'] else 'DEAD'}, {f['requests_per_s']:.1f} req/s, "
          f"{f['tokens_per_s']:.1f} tok/s, rss growth "
          + (" ".join(f"{n} {g:+.1f}%" for n, g in growth.items()) or "n/a"))
    if args.json_out:
        args.json_out.write_text(json.dumps(f, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
