"""Recovery time after a shard dies: SIGKILL one rank of a running server, then time until /health
answers 503, until it answers 200 again, and until the first 200 of a /generate sent right after
the kill (it waits in the queue while the launcher restarts the group and the router warms it up).

    python benchmarks/shard_recovery.py                      # SmolLM2 (the default model), 3 kills
    python benchmarks/shard_recovery.py --model-dir DIR --num-shard 2 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.http_bench import start_server  # noqa: E402

PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


def _status(url: str, path: str, body: dict | None = None, timeout: float = 300) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{url}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def shard_pids(uds_path: str) -> dict[int, int]:
    """rank -> pid of the shard processes serving on `uds_path` (their RANK variable)."""
    found = subprocess.run(["pgrep", "-f", f"shard --model-path .* --uds-path {uds_path} "],
                           capture_output=True, text=True)
    pids = {}
    for pid in map(int, found.stdout.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                pids[int(entry[5:])] = pid
    return pids


def _until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise RuntimeError("timed out")
        time.sleep(0.02)
    return time.monotonic() - started


def one_kill(url: str, uds_path: str, rank: int) -> dict:
    """Kills `rank`; returns seconds from the kill to each milestone."""
    pids = shard_pids(uds_path)
    first_generate: dict = {}

    def generate_after_kill():
        status = _status(url, "/generate", PROMPT)
        first_generate.update(status=status, at=time.monotonic())

    os.kill(pids[rank], signal.SIGKILL)
    killed = time.monotonic()
    sender = threading.Thread(target=generate_after_kill)
    sender.start()
    unhealthy = _until(lambda: _status(url, "/health", timeout=5) == 503, 60)
    healthy = unhealthy + _until(lambda: _status(url, "/health", timeout=5) == 200, 600)
    sender.join(timeout=600)
    if first_generate.get("status") != 200:
        raise RuntimeError(f"the request sent after the kill answered {first_generate}")
    return {"health_503_s": unhealthy, "health_200_s": healthy,
            "first_generate_200_s": first_generate["at"] - killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="model directory (default: SmolLM2, prepared once)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-shard", type=int, default=1)
    parser.add_argument("--rank", type=int, default=None, help="rank to kill (default: the last)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from launcher.prepare import prepare_default_model
        model_dir = str(prepare_default_model(dtype="float32"))
    rank = args.num_shard - 1 if args.rank is None else args.rank
    process, url = start_server(args.dtype, [
        "--model-id", model_dir, "--num-shard", str(args.num_shard),
        "--max-shard-restarts", str(args.repeats), "--shard-restart-window", "3600"])
    uds_path = f"/tmp/tgi-py-bench-{url.rsplit(':', 1)[1]}"
    runs = []
    try:
        if _status(url, "/generate", PROMPT) != 200:
            raise RuntimeError("the server does not answer before the first kill")
        for i in range(args.repeats):
            runs.append(one_kill(url, uds_path, rank))
            print(f"kill {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()),
                  flush=True)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    print(f"\n{Path(model_dir).name}, {args.dtype}, {args.num_shard} shard(s), rank {rank} "
          f"SIGKILLed {args.repeats} times")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"  {key:22s} min {min(values):6.2f}  median {statistics.median(values):6.2f}  "
              f"max {max(values):6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=2))


if __name__ == "__main__":
    main()
