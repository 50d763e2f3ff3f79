"""Starts the shards and the router as child processes, waits until they serve, and stops them together.

A shard that exits gets the whole shard group restarted (every rank: the survivors wait in collectives
for a peer that is gone), up to --max-shard-restarts within --shard-restart-window; the router stays
up and reconnects by itself. Past that budget, or when the router exits, the launcher stops the others
and exits non-zero naming the child. SIGINT/SIGTERM stop the router first (it finishes in-flight
requests), then the shards, each SIGKILLed after a grace period.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher.config import LauncherConfig
from launcher.logs import relay, say
from shard.partition import split_heads_of


class LaunchError(RuntimeError):
    pass


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen
    tail: list[str] = field(default_factory=list)

    def exited(self) -> int | None:
        return self.process.poll()


def check_shardable(model_dir: Path, num_shard: int) -> None:
    """Fails before any process starts when the heads cannot be split over `num_shard` ranks."""
    try:
        split_heads_of(json.loads((model_dir / "config.json").read_text()), num_shard)
    except ValueError as err:
        raise LaunchError(f"--num-shard {num_shard}: {err}") from None


def _death(child: Child) -> str:
    last = "\n  ".join(child.tail[-10:])
    return f"{child.name} exited with code {child.exited()}; its last lines:\n  {last}"


def _spawn(name: str, argv: list[str], env: dict[str, str], json_output: bool) -> Child:
    # own session: a Ctrl-C in the terminal reaches only the launcher, which stops children in order
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    child = Child(name, process)
    relay(process.stdout, name, json_output=json_output, tail=child.tail)
    return child


class Supervisor:
    def __init__(self, config: LauncherConfig, model_dir: Path, model_name: str):
        self.config = config
        self.model_dir = model_dir
        self.model_name = model_name
        self.children: list[Child] = []
        self.stop_requested = threading.Event()
        self.shard_restarts: deque[float] = deque()  # when each restart of the group happened

    def _say(self, message: str, level: str = "INFO") -> None:
        say(message, json_output=self.config.json_output, level=level)

    def socket_path(self, rank: int) -> str:
        return f"{self.config.shard_uds_path}-{rank}"

    def run(self) -> int:
        """Starts everything, supervises until a signal or a death; returns the exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop_requested.set())
        try:
            self._start_shards()
            self._start_router()
            self._say(f"serving {self.model_name} on http://{self._router_host()}:{self.config.port}")
            return self._watch()
        except LaunchError as err:
            self._say(str(err), level="ERROR")
            return 1
        finally:
            self.shutdown()

    def _start_shards(self, *, wait: bool = True) -> None:
        config = self.config
        for rank in range(config.num_shard):
            path = self.socket_path(rank)
            if os.path.exists(path):
                os.unlink(path)  # stale socket of an earlier run
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(config.num_shard),
                   "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(config.master_port)}
            argv = [sys.executable, "-m", "shard", "--model-path", str(self.model_dir),
                    "--uds-path", config.shard_uds_path, "--dtype", config.dtype,
                    "--device", config.device, "--block-size", str(config.block_size),
                    *config.shard_tracing_argv()]
            self.children.append(_spawn(f"shard {rank}", argv, env, config.json_output))
        if not wait:
            return
        self._wait_until("shards ready", lambda: all(
            os.path.exists(self.socket_path(r)) for r in range(config.num_shard)))

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "router",
                *self.config.router_argv(tokenizer_path=str(self.model_dir),
                                         model_id=self.model_name)]
        self.children.append(_spawn("router", argv, dict(os.environ), self.config.json_output))
        self._wait_until("router ready", self._router_healthy)

    def _router_host(self) -> str:
        host = self.config.router.get("hostname") or "0.0.0.0"
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def _router_healthy(self) -> bool:
        url = f"http://{self._router_host()}:{self.config.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_until(self, what: str, ready, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._raise_if_dead()
            if self.stop_requested.is_set():
                raise LaunchError(f"stopped by a signal while waiting for: {what}")
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f}s waiting for: {what}")
            time.sleep(0.1)

    def _raise_if_dead(self) -> None:
        for child in self.children:
            if child.exited() is not None:
                raise LaunchError(_death(child))

    def _watch(self) -> int:
        while not self.stop_requested.wait(0.1):
            dead = [c for c in self.children if c.exited() is not None]
            for child in dead:
                if child.name == "router":
                    raise LaunchError(_death(child))
            if dead:
                self._restart_shards(dead[0])
        self._say("stopping")
        return 0

    def _restart_shards(self, dead: Child) -> None:
        """Restarts every rank when one died, or raises when the restart budget is spent."""
        config = self.config
        now = time.monotonic()
        while self.shard_restarts and now - self.shard_restarts[0] > config.shard_restart_window:
            self.shard_restarts.popleft()
        shards = [c for c in self.children if c.name != "router"]
        if len(self.shard_restarts) >= config.max_shard_restarts:
            # the survivors would hold the router's step in a collective through its drain
            self._kill(shards)
            raise LaunchError(f"{_death(dead)}\n(the shard group was restarted "
                              f"{len(self.shard_restarts)} times within "
                              f"{config.shard_restart_window} s: --max-shard-restarts "
                              f"{config.max_shard_restarts} is used up)")
        self.shard_restarts.append(now)
        self._say(f"{dead.name} exited with code {dead.exited()}; restarting the shard group "
                  f"(restart {len(self.shard_restarts)} of {config.max_shard_restarts} within "
                  f"{config.shard_restart_window} s)", level="WARNING")
        self._kill(shards)  # waiting in a collective for the dead rank: nothing to save
        for child in shards:
            self.children.remove(child)
        self._start_shards(wait=False)  # the router notices the new group and warms it up

    def _kill(self, children: list[Child]) -> None:
        """SIGKILL to each child's whole process group (a shard's compiler, say), then reaped. A
        leader that already died may leave members behind: its group is killed all the same (its
        id cannot be reused while a member lives)."""
        for child in children:
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            try:
                child.process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver): move on
                self._say(f"{child.name} did not die after SIGKILL", level="WARNING")

    def shutdown(self) -> None:
        """Router first, so it stops taking requests while the shards still answer; then shards."""
        grace = self.config.graceful_termination_timeout
        routers = [c for c in self.children if c.name == "router"]
        shards = [c for c in self.children if c.name != "router"]
        for group in (routers, shards):
            for child in group:
                if child.exited() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for child in group:
                try:
                    child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self._say(f"{child.name} did not stop in {grace}s; killing it", level="WARNING")
                    self._kill([child])
        for rank in range(self.config.num_shard):
            if os.path.exists(self.socket_path(rank)):
                os.unlink(self.socket_path(rank))
        self.children.clear()
