"""The launcher's supervisor: the default model's shards and the router as child processes.

It starts them, waits until they serve, serves the router's model-lifecycle calls
(launcher/model_host.py), and stops everything together.

Every model that runs has a shard group of its own. A shard that exits gets its whole group
restarted (every rank: the survivors wait in collectives for a peer that is gone), up to
--max-shard-restarts within --shard-restart-window; the router stays up and reconnects by itself.
Past that budget the default model's group stops everything with a non-zero exit naming the child;
another model's group is stopped alone (the router answers for that model that its shards are
lost). When the router exits, the launcher stops the others and exits non-zero. SIGINT/SIGTERM stop
the router first, then the shards, each SIGKILLed after a grace period. The router's drain ends
before its grace does (router_drain_timeout): the requests still running then get their 503, or
their stream's error event, from the router itself before it exits.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from launcher.adapters import router_adapters_argv
from launcher.config import LauncherConfig
from launcher.gpus import pick_gpus, visible_gpus
from launcher.liveness import Liveness
from launcher.local_roots import pull_roots
from launcher.logs import say
from launcher.router_flags import router_drain_timeout
from launcher.shard_group import (Child, GroupSpec, LaunchError, ShardGroup, death, spawn,
                                  terminate, threads_env)
from launcher.stop_flag import StopFlag
from shard.models import architecture_of
from shard.partition import split_heads_of

__all__ = ["LaunchError", "Supervisor", "check_shardable"]

# the router's /health is this machine's own: never asked through http_proxy and its kind, which
# urllib honours (a proxy cannot reach 127.0.0.1 here, and start-up would wait out its timeout)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def check_shardable(model_dir: Path, num_shard: int) -> None:
    """The check, before any process starts, that `num_shard` shards can serve the model.

    It fails when the shards do not serve the model's architecture, or its heads cannot be split
    over `num_shard` ranks."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
        # the sentence a shard would die with when it loads, naming the architectures served
        architecture_of(config)
    except (ValueError, OSError, AttributeError) as err:  # AttributeError: not a JSON object
        raise LaunchError(f"{path} does not describe a model this server serves: {err}") from None
    try:
        split_heads_of(config, num_shard)
    except ValueError as err:
        raise LaunchError(f"--num-shard {num_shard}: {err}") from None
    except (KeyError, TypeError, AttributeError) as err:  # a config.json of another shape
        raise LaunchError(f"{path} does not describe a model this server serves "
                          f"({type(err).__name__}: {err})") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, config: LauncherConfig, model_dir: Path, model_name: str, *,
                 adapter_dirs: dict[str, Path] | None = None):
        self.config = config
        self.model_dir = model_dir
        self.model_name = model_name
        # --lora-adapters resolved: {name: local directory}, which the router loads
        self.adapter_dirs = adapter_dirs or {}
        self.router: Child | None = None
        self.groups: dict[str, ShardGroup] = {}  # by model id
        self.lock = threading.Lock()  # groups is shared with the model host's threads
        self.stop_requested = StopFlag()  # set by signal handlers: see launcher/stop_flag.py
        self._group_numbers = iter(range(1, 1 << 30))
        self._host = None
        self.liveness: Liveness | None = None  # started once the default group serves

    def _say(self, message: str, level: str = "INFO") -> None:
        say(message, json_output=self.config.json_output, level=level)

    @property
    def host_socket(self) -> str:
        return f"{self.config.shard_uds_path}-host"

    @property
    def kv_ledger(self) -> str:
        """The directory where this launcher's shards write down their CPU KV pools.

        So that each model's pool is sized from what the others leave (shard/kv_budget.py)."""
        return f"{self.config.shard_uds_path}-kv-ledger"

    def run(self) -> int:
        """Starts everything, supervises until a signal or a death; returns the exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop_requested.set())
        shutil.rmtree(self.kv_ledger, ignore_errors=True)  # an earlier run's, its pids reused
        try:
            default = self._group(self.model_name, self.model_dir, self.config.num_shard,
                                  self.config.dtype, self.config.device,
                                  uds_prefix=self.config.shard_uds_path,
                                  master_port=self.config.master_port, label="",
                                  ranks_here=len(self.config.local_ranks))
            config = self.config
            if config.nnodes > 1:
                default.spec.local_ranks = config.local_ranks
                default.spec.grpc_host = config.node_address
                default.spec.grpc_base_port = config.shard_grpc_port
            with self.lock:
                self.groups[self.model_name] = default
            default.spawn()
            self._wait_until("shards ready", default.ready, group=default)
            default.supervise()
            if config.shard_hang_timeout > 0:
                self.liveness = Liveness(self._running_shards, config.shard_hang_timeout)
                self.liveness.start()
            if config.node_rank > 0:
                ranks = config.local_ranks
                self._say(f"machine {config.node_rank} of {config.nnodes}: ranks {ranks.start}-"
                          f"{ranks.stop - 1} of {self.model_name} serve machine 0's router")
                return self._watch()
            self._start_model_host()
            self._start_router()
            self._say(f"serving {self.model_name} on http://{self._router_host()}:{self.config.port}")
            return self._watch()
        except LaunchError as err:
            self._say(str(err), level="ERROR")
            return 1
        finally:
            self.shutdown()

    def _group(self, name: str, model_dir: Path, num_shard: int, dtype: str | None, device: str,
               *, uds_prefix: str, master_port: int, label: str,
               ranks_here: int | None = None, cpu_threads: int = 0) -> ShardGroup:
        """A shard group's processes, not yet started.

        On GPUs, its ranks (`ranks_here` of them on this machine, every one by default) get the GPUs
        the other groups use least. Called with the lock held, or before any other group exists."""
        # no dtype: "", each shard takes its device's default
        device, gpus = self._placement(name, device, ranks_here or num_shard)
        spec = GroupSpec(name, model_dir, num_shard, dtype or "", device, uds_prefix,
                         master_port, label, gpus=gpus)
        config = self.config
        return ShardGroup(
            spec, block_size=config.block_size, master_addr=config.master_addr,
            quantize=config.shard_quantize or "", speculate=config.speculate,
            compile_decode=config.compile_decode, cuda_graphs=config.cuda_graphs,
            memory_fraction=config.cuda_memory_fraction, kv_ledger=self.kv_ledger,
            tracing_argv=config.shard_tracing_argv(),
            extra_argv=config.shard_settings_argv(default_model=name == self.model_name),
            extra_env={**config.shard_env(), **threads_env(cpu_threads)},
            json_output=config.json_output)

    def _placement(self, name: str, device: str, ranks: int) -> tuple[str, tuple[str, ...]]:
        """(the group's --device, the GPUs its ranks get)."""
        if device == "cpu":
            return device, ()
        visible = visible_gpus(os.environ)
        if not visible:
            return device, ()
        in_use = [gpu for group in self.groups.values() for gpu in group.spec.gpus]
        try:
            return device, pick_gpus(visible, in_use, ranks)
        except ValueError as err:
            if device == "cuda":
                raise LaunchError(f"{name}: {err}") from None
        # auto with too few GPUs: left to choose, the ranks past the GPUs' count would each
        # ask for a GPU that does not exist (an invalid device ordinal); all of them on the CPU
        self._say(f"{name}: {ranks} shard(s) need as many GPUs, {len(visible)} visible: serving "
                  "on the CPU (--device cuda refuses instead)", level="WARNING")
        return "cpu", ()

    def _start_model_host(self) -> None:
        from launcher.model_host import serve  # grpc only once the shards are up

        if os.path.exists(self.host_socket):
            os.unlink(self.host_socket)
        self._host = serve(self, self.host_socket)

    def _start_router(self) -> None:
        drain = router_drain_timeout(self.config.graceful_termination_timeout)
        argv = [sys.executable, "-m", "router",
                *self.config.router_argv(tokenizer_path=str(self.model_dir),
                                         model_id=self.model_name),
                "--model-host-uds-path", self.host_socket,
                "--model-registry-dir", str(self.config.registry_dir()),
                "--default-model-dtype", self.config.dtype or "",
                "--default-model-device", self.config.device,
                "--drain-timeout", str(drain),
                *router_adapters_argv(self.adapter_dirs),
                # what the model host allows, the flag's own directories among them: the last
                # --allowed-local-model-path is the one the router keeps
                "--allowed-local-model-path", pull_roots(self.config).as_flag()]
        self.router = spawn("router", argv, dict(os.environ), self.config.json_output)
        self._wait_until("router ready", self._router_healthy)

    def _router_host(self) -> str:
        host = self.config.router.get("hostname") or "0.0.0.0"
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def _router_healthy(self) -> bool:
        url = f"http://{self._router_host()}:{self.config.port}/health"
        try:
            with _DIRECT.open(url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_until(self, what: str, ready, *, group: ShardGroup | None = None,
                    timeout: float = 600.0) -> None:
        """The wait for `ready`, failed by the router's or `group`'s death, a signal or the timeout.

        Without a group, supervised groups are watched meanwhile as `_watch` does (a shard that dies
        while the router starts is restarted, or ends the launch)."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.router is not None and self.router.exited() is not None:
                raise LaunchError(death(self.router))
            dead = group.dead_child() if group is not None else None
            if dead is not None:
                raise LaunchError(death(dead))
            if group is None:
                self._restart_dead_groups()
            if self.stop_requested.is_set():
                raise LaunchError(f"stopped (a signal, or the launcher shutting down) while "
                                  f"waiting for: {what}")
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f}s waiting for: {what}")
            time.sleep(0.1)

    def _watch(self) -> int:
        while not self.stop_requested.is_set():
            if self.router is not None and self.router.exited() is not None:
                raise LaunchError(death(self.router))
            self._restart_dead_groups()
            time.sleep(0.1)
        self._say("stopping")
        return 0

    def _restart_dead_groups(self) -> None:
        # under the lock: a group the model host is stopping must not be restarted
        with self.lock:
            for group in [g for g in self.groups.values() if g.supervised]:
                dead = group.dead_child()
                if dead is not None:
                    self._restart(group, dead)
                    continue
                stuck = self._stuck_child(group)
                if stuck is not None:
                    self._restart(group, *stuck)

    def _running_shards(self) -> list[tuple[int, str]]:
        """What the liveness thread asks: (pid, socket) of each running rank whose socket is up.

        The ranks are those of the supervised groups on this machine."""
        with self.lock:
            groups = [g for g in self.groups.values() if g.supervised]
            return [(child.process.pid, group.socket_path(rank))
                    for group in groups for child, rank in zip(group.children, group.spec.ranks)
                    if child.exited() is None and os.path.exists(group.socket_path(rank))]

    def _stuck_child(self, group: ShardGroup) -> tuple[Child, str] | None:
        if self.liveness is None:
            return None
        for child in group.children:
            silence = self.liveness.silent_for(child.process.pid)
            if silence is not None:
                return child, (f"{child.name} has not answered its health check for "
                               f"{silence:.0f} s (stopped or hung; --shard-hang-timeout "
                               f"{self.config.shard_hang_timeout})")
        return None

    def _restart(self, group: ShardGroup, dead: Child, why: str | None = None) -> None:
        """The restart of every rank of a group when one died (or, `why`, hangs).

        Past the budget it stops the group (and, for the default model, everything). Called with the
        lock held."""
        config = self.config
        what = why or death(dead)  # with the dead child's last lines
        if config.nnodes > 1 and group.spec.name == self.model_name:
            # the other machines' ranks are still in the old process group
            group.kill(self._say)  # a hung rank, if that is it, ends with the rest
            raise LaunchError(f"{what}\n(a model split across machines is not restarted: "
                              "start the launcher on every machine again)")
        if not group.may_restart(config.max_shard_restarts, config.shard_restart_window):
            # the survivors would hold the router's step in a collective through its drain
            group.kill(self._say)
            spent = (f"{what}\n(the shard group of {group.spec.name} was restarted "
                     f"{len(group.restarts)} times within {config.shard_restart_window} s: "
                     f"--max-shard-restarts {config.max_shard_restarts} is used up)")
            if group.spec.name == self.model_name:
                raise LaunchError(spent)
            self._say(spent, level="ERROR")
            self.groups.pop(group.spec.name, None)
            group.remove_sockets()
            return
        cause = why or f"{dead.name} exited with code {dead.exited()}"
        self._say(f"{cause}; restarting the shard group of "
                  f"{group.spec.name} (restart {len(group.restarts)} of "
                  f"{config.max_shard_restarts} within {config.shard_restart_window} s)",
                  level="WARNING")
        group.kill(self._say)  # waiting in a collective for the dead rank: nothing to save
        group.spawn()  # the router notices the new group and warms it up

    # the model host's calls (gRPC worker threads)

    def start_group(self, name: str, model_dir: Path, *, num_shard: int, dtype: str | None,
                    device: str, cpu_threads: int = 0) -> str:
        """Rank 0's socket of a model's shard group, started and listening on every rank.

        Starts the group and returns once every rank listens; a group already running answers at
        once."""
        check_shardable(model_dir, num_shard)
        with self.lock:
            existing = self.groups.get(name)
            if existing is not None:
                if existing.supervised:
                    return existing.master_socket
                raise LaunchError(f"the shard group of {name} is already starting")
            if self.config.nnodes > 1 and name == self.model_name:
                raise LaunchError(f"{name} is split across {self.config.nnodes} machines: restart "
                                  "the launchers on every machine to start it again")
            if self.stop_requested.is_set():
                raise LaunchError("the launcher is stopping")
            number = next(self._group_numbers)
            group = self._group(name, model_dir, num_shard, dtype, device,
                                uds_prefix=f"{self.config.shard_uds_path}-g{number}",
                                master_port=_free_port(), label=f"model {number}",
                                cpu_threads=cpu_threads)
            self.groups[name] = group  # claimed: a second start of this name waits its turn
        self._say(f"starting {name} ({num_shard} shard(s), {dtype or 'default dtype'}, {device}) "
                  f"from {model_dir}")
        try:
            group.spawn()
            self._wait_until(f"shards of {name} ready", group.ready, group=group)
        except BaseException as err:  # an OSError from Popen too: no rank may outlive its group
            with self.lock:
                if self.groups.get(name) is group:
                    self.groups.pop(name)
            group.kill(self._say)
            group.remove_sockets()
            if isinstance(err, Exception) and not isinstance(err, LaunchError):
                raise LaunchError(f"the shards of {name} could not start: {err}") from err
            raise
        group.supervise()
        return group.master_socket

    def group_names(self) -> list[str]:
        with self.lock:
            return list(self.groups)

    def stop_group(self, name: str) -> None:
        with self.lock:
            group = self.groups.pop(name, None)
            if group is not None:
                group.stop_supervising()
        if group is not None:
            self._say(f"stopping the shards of {name}")
            group.stop(self.config.graceful_termination_timeout, self._say)

    def shutdown(self) -> None:
        """Router first, so it stops taking requests while the shards still answer; then shards."""
        grace = self.config.graceful_termination_timeout
        self.stop_requested.set()  # a StartGroup still waiting for its shards gives up
        if self.liveness is not None:
            self.liveness.stop()
        if self.router is not None:
            terminate([self.router], grace, self._say)
            self.router = None
        if self._host is not None:
            self._host.stop(grace=None)
            self._host = None
        with self.lock:
            groups = list(self.groups.values())
            self.groups.clear()
        terminate([c for g in groups for c in g.children], grace, self._say)
        for group in groups:
            group.children.clear()
            group.remove_sockets()
        if os.path.exists(self.host_socket):
            os.unlink(self.host_socket)
        shutil.rmtree(self.kv_ledger, ignore_errors=True)


