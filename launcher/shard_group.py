"""One model's shard processes: one per tensor-parallel rank, started, watched and stopped together.

A rank that dies leaves the others waiting in a collective for it, so a group is restarted whole, up
to `max_restarts` times within `restart_window` seconds.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher.logs import relay
from proto.launcher_watch import LAUNCHER_PID_ENV
from proto.logs import child_log_environment
from shard.config import AUTO_CUDA_GRAPHS, KV_LEDGER_ENV

# How long (busy-wait iterations) a shard's idle OpenMP threads spin before they sleep, where the
# environment says nothing of it (GOMP_SPINCOUNT, OMP_WAIT_POLICY). libgomp's default, 300,000,
# keeps a thread spinning through the gap between two decode steps, on a core the router and the
# shard's gRPC thread then wait for; within a step the gaps between kernels are far shorter than
# 20,000. On the 2-vCPU AVX-512 machine of benchmarks/RESULTS.md, over HTTP: 32 streams 4-7% and 8
# streams 4-6% more tokens/s, one stream unchanged. Read by libgomp when the process starts, so it
# is set here, not in the shard.
OPENMP_SPIN_COUNT = "20000"


class LaunchError(RuntimeError):
    pass


def threads_env(cpu_threads: int) -> dict[str, str]:
    """A model's `cpu_threads` (Jan's setting) as its shards' environment: torch's thread count."""
    return {"OMP_NUM_THREADS": str(cpu_threads)} if cpu_threads else {}


def openmp_environment(environ: dict[str, str]) -> dict[str, str]:
    """The OpenMP settings a shard process gets on top of `environ`."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen
    tail: list[str] = field(default_factory=list)

    def exited(self) -> int | None:
        return self.process.poll()


def death(child: Child) -> str:
    last = "\n  ".join(child.tail[-10:])
    return f"{child.name} exited with code {child.exited()}; its last lines:\n  {last}"


def spawn(name: str, argv: list[str], env: dict[str, str], json_output: bool) -> Child:
    # own session: a Ctrl-C in the terminal reaches only the launcher, which stops children in
    # order; and a child stops itself once this launcher is gone (proto.launcher_watch). It logs
    # as the launcher does, under the name its lines are relayed with.
    env = {**env, LAUNCHER_PID_ENV: str(os.getpid()),
           **child_log_environment(json_output=json_output, source=name)}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    child = Child(name, process)
    relay(process.stdout, name, json_output=json_output, tail=child.tail)
    return child


def kill(children: list[Child], say) -> None:
    """SIGKILL to each child's whole process group (a shard's compiler, say), then reaped.

    A leader that already died may leave members behind: its group is killed all the same (its id
    cannot be reused while a member lives)."""
    for child in children:
        try:
            os.killpg(child.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in children:
        try:
            child.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver): move on
            say(f"{child.name} did not die after SIGKILL", level="WARNING")


def terminate(children: list[Child], grace: float, say) -> None:
    """SIGTERM, then SIGKILL for those still running after `grace` seconds."""
    for child in children:
        if child.exited() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            say(f"{child.name} did not stop in {grace}s; killing it", level="WARNING")
            kill([child], say)


@dataclass(slots=True)
class GroupSpec:
    name: str  # the model id
    model_dir: Path
    num_shard: int
    dtype: str  # "": each shard takes its device's default (shard.config.default_dtype)
    device: str
    uds_prefix: str  # rank r listens on <uds_prefix>-<r>
    master_port: int
    label: str = ""  # prefix of the children's log names ("" for the default model)
    # tensor parallelism across machines: the ranks this machine runs, and where each listens
    # for the router over TCP (host, base port: rank r on base + r); one machine runs them all
    local_ranks: range | None = None
    grpc_host: str = ""
    grpc_base_port: int = 0
    # the GPUs its ranks see (CUDA_VISIBLE_DEVICES; rank r of this machine takes the r-th), or
    # () to leave the launcher's environment as it is (no GPU, or on the CPU)
    gpus: tuple[str, ...] = ()

    @property
    def ranks(self) -> range:
        return self.local_ranks if self.local_ranks is not None else range(self.num_shard)


class ShardGroup:
    def __init__(self, spec: GroupSpec, *, block_size: int, master_addr: str,
                 tracing_argv: list[str], json_output: bool, quantize: str = "",
                 speculate: int = 0, compile_decode: bool = False,
                 cuda_graphs: str = AUTO_CUDA_GRAPHS, memory_fraction: float = 1.0,
                 kv_ledger: str = "", extra_argv: list[str] | None = None,
                 extra_env: dict[str, str] | None = None):
        self.spec = spec
        # the rest of the launcher's shard settings (rope override, watermark, kernels off)
        self.extra_argv = extra_argv or []
        self.extra_env = extra_env or {}
        self.memory_fraction = memory_fraction
        self.kv_ledger = kv_ledger  # where the launcher's groups write down their CPU KV pools
        self.cuda_graphs = cuda_graphs
        self.speculate = speculate
        self.compile_decode = compile_decode
        self.block_size = block_size
        self.quantize = quantize
        self.master_addr = master_addr
        self.tracing_argv = tracing_argv
        self.json_output = json_output
        self.children: list[Child] = []
        self.restarts: deque[float] = deque()  # when each restart happened
        # False while the caller that started it waits for it: a death then is that caller's error
        self.supervised = False

    def supervise(self) -> None:
        """Marks the group started: from now on a death is the supervisor's to handle."""
        self.supervised = True

    def stop_supervising(self) -> None:
        """Marks the group as going away: a death now is expected, not restarted."""
        self.supervised = False

    def socket_path(self, rank: int) -> str:
        return f"{self.spec.uds_prefix}-{rank}"

    @property
    def master_socket(self) -> str:
        return self.socket_path(0)

    def spawn(self) -> None:
        spec = self.spec
        for rank in spec.ranks:
            path = self.socket_path(rank)
            if os.path.exists(path):
                os.unlink(path)  # stale socket of an earlier run
            env = {**os.environ, **openmp_environment(os.environ),
                   "RANK": str(rank), "WORLD_SIZE": str(spec.num_shard),
                   # this machine's share: which GPU, and how many ranks share its cores
                   "LOCAL_RANK": str(rank - spec.ranks.start),
                   "LOCAL_WORLD_SIZE": str(len(spec.ranks)),
                   "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(spec.master_port)}
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
            if self.kv_ledger:
                env[KV_LEDGER_ENV] = self.kv_ledger
            env.update(self.extra_env)
            argv = [sys.executable, "-m", "shard", "--model-path", str(spec.model_dir),
                    "--uds-path", spec.uds_prefix, "--dtype", spec.dtype,
                    "--device", spec.device, "--block-size", str(self.block_size),
                    "--quantize", self.quantize, "--speculate", str(self.speculate),
                    "--compile-decode", str(int(self.compile_decode)),
                    "--cuda-graphs", self.cuda_graphs,
                    "--memory-fraction", str(self.memory_fraction),
                    *self.tracing_argv, *self.extra_argv]
            if spec.grpc_host:
                argv += ["--grpc-address", f"{spec.grpc_host}:{spec.grpc_base_port + rank}"]
            name = f"{spec.label} shard {rank}" if spec.label else f"shard {rank}"
            self.children.append(spawn(name, argv, env, self.json_output))

    def ready(self) -> bool:
        return all(os.path.exists(self.socket_path(r)) for r in self.spec.ranks)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def may_restart(self, max_restarts: int, window: float) -> bool:
        """Counts a restart when the budget allows one."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > window:
            self.restarts.popleft()
        if len(self.restarts) >= max_restarts:
            return False
        self.restarts.append(now)
        return True

    def kill(self, say) -> None:
        kill(self.children, say)
        self.children.clear()

    def stop(self, grace: float, say) -> None:
        terminate(self.children, grace, say)
        self.children.clear()
        self.remove_sockets()

    def remove_sockets(self) -> None:
        for rank in self.spec.ranks:
            if os.path.exists(self.socket_path(rank)):
                os.unlink(self.socket_path(rank))
