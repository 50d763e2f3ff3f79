"""Normal requests' latency while hostile clients and files attack the server, beside a quiet run.

A steady load of normal requests (`--concurrency` clients, each sending `/generate` of
`--new-tokens` tokens back to back) runs for `--seconds` alone, then as long again while attackers
replay what one client with a valid key could do to the others:
- `adapter_pattern`: loads an adapter whose `rank_pattern` key backtracks for minutes as a regex;
- `grpc_unread`: opens public gRPC streams and never reads them;
- `sglang_hidden`: streams SGLang answers with `return_hidden_states` for a long prompt;
- `sglang_unread`: SGLang streams with `return_logprob` whose reader stops after the headers;
- `adapter_churn`: loads rank-64 adapters past `--max-loras` and unloads them, over and over;
- `template_loop` / `template_alloc`: chats to a model whose chat template loops 2x10^7 steps or
  builds a 100 MB string.
It prints each attacker's outcomes and the normal requests' p50 and p99 in both runs; the bound is
a p99 within 1.5x of the quiet run's, and every normal request answered 200. Exits 1 otherwise.

    python benchmarks/hostile_load.py --model-dir DIR [--seconds 30] [--concurrency 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import free_port, launch  # noqa: E402

BOUND = 1.5
ATTACKS = ["adapter_pattern", "grpc_unread", "sglang_hidden", "sglang_unread", "adapter_churn",
           "template_loop", "template_alloc"]
TEMPLATES = {
    "template_loop": "{% for i in range(20000000) %}{% endfor %}{{ messages[0]['content'] }}",
    "template_alloc": "{{ 'a' * 100000000 }}{{ messages[0]['content'] }}",
}


def hostile_adapter(model_dir: Path, out: Path) -> Path:
    """A working adapter whose config adds a rank_pattern key that backtracks as a regex."""
    from tests.lora_adapters import build_adapter

    build_adapter(model_dir, out, rank=4, seed=7)
    config = json.loads((out / "adapter_config.json").read_text())
    config["rank_pattern"] = {"(.*.*)*x": 4, "(a|aa)+$": 4}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def template_model(model_dir: Path, out: Path, template: str) -> Path:
    """The model's files with `template` as its chat template."""
    shutil.copytree(model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


async def normal_client(session: aiohttp.ClientSession, url: str, new_tokens: int,
                        until: float, latencies: list[float], statuses: Counter) -> None:
    body = {"inputs": "The quick brown fox jumps over the lazy dog and",
            "parameters": {"max_new_tokens": new_tokens}}
    while time.monotonic() < until:
        start = time.monotonic()
        async with session.post(f"{url}/generate", json=body) as response:
            await response.read()
            statuses[response.status] += 1
        latencies.append(time.monotonic() - start)


async def normal_load(url: str, args, seconds: float) -> tuple[list[float], Counter]:
    latencies: list[float] = []
    statuses: Counter = Counter()
    until = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(normal_client(session, url, args.new_tokens, until, latencies,
                                             statuses) for _ in range(args.concurrency)))
    return latencies, statuses


async def repeat(name: str, attack, until: float, outcomes: Counter, pause: float) -> None:
    """Runs `attack` (returning an outcome label) until `until`, tallying its outcomes."""
    while time.monotonic() < until:
        import grpc

        try:
            outcomes[f"{name}: {await attack()}"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            outcomes[f"{name}: {type(error).__name__}"] += 1
        except grpc.aio.AioRpcError as error:
            outcomes[f"{name}: {error.code().name}"] += 1
        await asyncio.sleep(pause)


class Attackers:
    """Each attack of the module's docstring, as a coroutine returning what it was answered."""

    def __init__(self, session: aiohttp.ClientSession, url: str, grpc_target: str,
                 files: dict[str, Path], max_loras: int, prompt_words: int):
        self.session, self.url, self.grpc_target = session, url, grpc_target
        self.files, self.max_loras = files, max_loras
        self.long_prompt = " ".join(["token"] * prompt_words)
        self.loaded: list[str] = []
        self.refused = False
        self.serial = 0
        self.streams: list = []

    async def _post(self, path: str, body: dict) -> int:
        async with self.session.post(f"{self.url}{path}", json=body) as response:
            await response.read()
            return response.status

    async def adapter_pattern(self) -> str:
        self.serial += 1
        name = f"hostile-{self.serial}"
        status = await self._post("/v1/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(self.files["hostile"])})
        if status == 200:  # its keys matched no module: a valid adapter, given back at once
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        return str(status)

    async def adapter_churn(self) -> str:
        """Loads until --max-loras refuses one, then unloads the oldest, and again."""
        self.serial += 1
        if self.refused and self.loaded:
            self.refused = False
            return "unload " + str(await self._post("/v1/unload_lora_adapter",
                                                    {"lora_name": self.loaded.pop(0)}))
        name = f"churn-{self.serial}"
        status = await self._post("/v1/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(self.files["rank64"])})
        if status == 200:
            self.loaded.append(name)
        self.refused = status == 400
        return f"load {status}"

    async def sglang_hidden(self) -> str:
        body = {"text": self.long_prompt, "stream": True, "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
        size = 0
        async with self.session.post(f"{self.url}/generate", json=body) as response:
            async for chunk in response.content.iter_any():
                size += len(chunk)
        return f"{response.status} ({size >> 20} MB)" if size >= 1 << 20 else str(response.status)

    async def sglang_unread(self) -> str:
        body = {"text": "Tell me a long story", "stream": True, "return_logprob": True,
                "top_logprobs_num": 5, "token_ids_logprob": list(range(256)), "sampling_params": {"max_new_tokens": 200}}
        async with self.session.post(f"{self.url}/generate", json=body) as response:
            if response.status != 200:
                return f"{response.status} {(await response.text())[:200]}"
            await asyncio.sleep(5)  # reads nothing past the headers, then goes away
            return str(response.status)

    async def grpc_unread(self) -> str:
        import grpc

        from proto import api_pb2, api_pb2_grpc

        channel = grpc.aio.insecure_channel(self.grpc_target, options=[
            ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)])
        stub = api_pb2_grpc.TextGenerationStub(channel)
        call = stub.GenerateStream(api_pb2.GenerateRequest(
            inputs="Tell me a long story",
            parameters=api_pb2.GenerateParameters(max_new_tokens=100, details=True)))
        self.streams.append((channel, call))
        first = await call.read()  # starts the call, then never reads again
        return "opened" if first is not grpc.aio.EOF else "ended"

    async def chat(self, model: str) -> str:
        return str(await self._post("/v1/chat/completions", {
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}))

    async def close(self) -> None:
        for channel, call in self.streams:
            call.cancel()
            await channel.close()


async def pull_and_start(session: aiohttp.ClientSession, url: str, model_id: str,
                         path: Path) -> None:
    async with session.post(f"{url}/v1/models/pull", json={"model": str(path), "id": model_id}) as r:
        assert r.status < 300, await r.text()
    for _ in range(600):
        async with session.get(f"{url}/v1/models/{model_id}") as r:
            state = (await r.json()).get("state")
        if state == "downloaded":
            break
        await asyncio.sleep(0.5)
    async with session.put(f"{url}/v1/models/{model_id}/start") as r:
        assert r.status < 300, await r.text()


async def attacked_run(url: str, grpc_target: str, files: dict[str, Path], args
                       ) -> tuple[list[float], Counter, Counter]:
    outcomes: Counter = Counter()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        attackers = Attackers(session, url, grpc_target, files, args.max_loras, args.prompt_words)
        until = time.monotonic() + args.seconds
        schedule = {"adapter_pattern": (attackers.adapter_pattern, 1.0),
                    "adapter_churn": (attackers.adapter_churn, 0.2),
                    "sglang_hidden": (attackers.sglang_hidden, 1.0),
                    "sglang_unread": (attackers.sglang_unread, 0.5),
                    "grpc_unread": (attackers.grpc_unread, 1.0),
                    **{name: (lambda name=name: attackers.chat(name), 0.5) for name in TEMPLATES}}
        attacks = [repeat(name, attack, until, outcomes, pause)
                   for name, (attack, pause) in schedule.items() if name in args.attacks]
        try:
            (latencies, statuses), *_ = await asyncio.gather(
                normal_load(url, args, args.seconds), *attacks)
        finally:
            await attackers.close()
    return latencies, statuses, outcomes


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=1500,
                        help="the SGLang attackers' prompt (each word a token or two)")
    parser.add_argument("--attacks", type=lambda text: text.split(","), default=ATTACKS,
                        help=f"which to run, comma-separated (all: {','.join(ATTACKS)})")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("launcher_args", nargs="*", help="after --: more tgi-launcher flags")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hostile-load-"))
    files = {"hostile": hostile_adapter(args.model_dir, work / "hostile-adapter")}
    from tests.lora_adapters import build_adapter
    files["rank64"] = build_adapter(args.model_dir, work / "rank64-adapter", rank=64, seed=3)
    models = work / "models"
    for name, template in TEMPLATES.items():
        template_model(args.model_dir, models / name, template)
    grpc_port = free_port()
    server = launch(["--model-id", str(args.model_dir)], work / "server", extra=[
        "--grpc-port", str(grpc_port), "--max-loras", str(args.max_loras),
        "--allowed-local-model-path", str(work), *args.launcher_args])
    try:
        async def prepare_models():
            async with aiohttp.ClientSession() as session:
                for name in TEMPLATES:
                    await pull_and_start(session, server.url, name, models / name)
        asyncio.run(prepare_models())
        asyncio.run(normal_load(server.url, args, min(3.0, args.seconds)))  # warm-up
        quiet, quiet_statuses = asyncio.run(normal_load(server.url, args, args.seconds))
        attacked, attacked_statuses, outcomes = asyncio.run(
            attacked_run(server.url, f"127.0.0.1:{grpc_port}", files, args))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"attackers' outcomes over {args.seconds:.0f} s:")
    for label, count in sorted(outcomes.items()):
        print(f"  {label:40s} {count}")
    rows = {"quiet": (quiet, quiet_statuses), "attacked": (attacked, attacked_statuses)}
    figures = {}
    print(f"normal requests ({args.concurrency} clients, {args.new_tokens} tokens each):")
    for name, (latencies, statuses) in rows.items():
        figures[name] = {"requests": len(latencies), "statuses": dict(statuses),
                         "p50_ms": 1000 * percentile(latencies, 50),
                         "p99_ms": 1000 * percentile(latencies, 99)}
        row = figures[name]
        print(f"  {name:9s} {row['requests']:5d} requests  p50 {row['p50_ms']:7.1f} ms  "
              f"p99 {row['p99_ms']:7.1f} ms  statuses {dict(statuses)}")
    ratio = figures["attacked"]["p99_ms"] / figures["quiet"]["p99_ms"]
    all_ok = set(attacked_statuses) == {200} and set(quiet_statuses) == {200}
    # an attacker answered a 5xx, or whose call failed or timed out: the server broke for it
    broken = sorted(label for label in outcomes
                    if re.search(r": (5\d\d|[A-Za-z]*Error|UNAVAILABLE|INTERNAL|UNKNOWN)", label))
    print(f"p99 attacked / quiet: {ratio:.2f}x (bound {BOUND}x); every normal request 200: "
          f"{all_ok}; attackers answered a 5xx or an error: {broken or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"ratio": ratio, "outcomes": dict(outcomes),
                                         "broken": broken, **figures}, indent=1))
    return 0 if ratio <= BOUND and all_ok and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
