"""Starts `tgi-launcher` on loopback for a test and stops it, checking nothing is left behind."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks.shard_recovery import shard_pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    process: subprocess.Popen
    url: str
    uds_path: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def processes_left(self) -> list[str]:
        found = subprocess.run(["pgrep", "-af", self.uds_path], capture_output=True, text=True)
        return [line for line in found.stdout.splitlines() if "pgrep" not in line]

    def shard_pids(self) -> dict[int, int]:
        """rank -> pid of the shard processes running now."""
        return shard_pids(self.uds_path)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code. A launcher still running after `timeout` fails the test
        with every process's stacks (SIGUSR1) and the log's tail, then the tree is killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            left = self.processes_left()
            for line in left:
                try:
                    os.kill(int(line.split()[0]), signal.SIGUSR1)
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(2)  # the stacks reach the log through the launcher's relay
            tail = self.log()[-20000:]
            for line in left:
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            self.process.kill()
            self.process.wait(timeout=30)
            raise AssertionError(f"the launcher did not stop {timeout:.0f}s after SIGTERM; "
                                 f"processes: {left}\nlog tail:\n{tail}") from None


def launch(model_args: list[str], tmp_path: Path, *, extra: list[str] = (),
           timeout: float = 300) -> LaunchedServer:
    port = free_port()
    uds_path = f"/tmp/tgi-py-test-{uuid.uuid4().hex[:8]}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / "launcher.log"
    argv = [sys.executable, "-m", "launcher", *model_args, "--port", str(port), "--hostname",
            "127.0.0.1", "--shard-uds-path", uds_path, "--master-port", str(free_port()),
            *extra]
    if "--model-registry-dir" not in extra:  # never the user's registry under ~/.cache
        argv += ["--model-registry-dir", str(tmp_path / "registry")]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=Path(__file__).resolve().parents[2], env=dict(os.environ))
    server = LaunchedServer(process, f"http://127.0.0.1:{port}", uds_path, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"launcher exited with {process.returncode}:\n{server.log()}")
        try:
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"launcher not ready in {timeout}s:\n{server.log()}")


def free_and_total_blocks(url: str) -> tuple[float, float]:
    """(free KV blocks + blocks only the prefix cache holds, all blocks) from /metrics: equal
    when no request holds a block (none leaked)."""
    values = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("tgi_kv_cache_free_blocks", "tgi_kv_cache_total_blocks",
                    "tgi_kv_cache_prefix_blocks"):
            values[name] = float(value)
    free = values["tgi_kv_cache_free_blocks"] + values.get("tgi_kv_cache_prefix_blocks", 0)
    return free, values["tgi_kv_cache_total_blocks"]
