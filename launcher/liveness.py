"""Which shards stopped answering: a hung shard's group is restarted as a dead one's is.

A shard that hangs (stopped by SIGSTOP, swapped out, wedged) does not exit, so waiting for deaths
alone left its requests waiting as long as it hung, and a tensor-parallel peer waiting on it failed
its collective for good at the group's timeout, while /health said 200. Each rank's Health
(answered by the shard's gRPC thread, not by its engine, so a long step does not count as a hang)
is asked every few seconds from a thread of its own; a rank that has not answered for `timeout`
seconds is stuck, and the supervisor restarts its group as it restarts the group of a dead one."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("tgi.launcher")

Probe = Callable[[str, float], bool]  # (a shard's unix socket, timeout) -> whether it answered


def health_probe(socket_path: str, timeout: float) -> bool:
    """Whether the shard on `socket_path` answers Health within `timeout` seconds."""
    import grpc  # the launcher loads grpc once shards run (launcher.model_host does the same)

    from proto import generate_pb2 as pb
    from proto import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        try:
            pb_grpc.TextGenerationServiceStub(channel).Health(pb.HealthRequest(), timeout=timeout)
            return True
        except grpc.RpcError:
            return False


class Liveness:
    """Since when each watched process has failed every probe.

    `targets()` lists what to watch now, as (process id, socket path) pairs: the supervised groups'
    running ranks."""

    def __init__(self, targets: Callable[[], list[tuple[int, str]]], timeout: float, *,
                 every: float = 2.0, probe: Probe = health_probe,
                 clock: Callable[[], float] = time.monotonic):
        self.targets = targets
        self.timeout = timeout
        self.every = every
        self.probe_timeout = min(every, 5.0)
        self.probe = probe
        self.clock = clock
        self.failing_since: dict[int, float] = {}  # pid -> its first failed probe of a run
        self.last_round = clock()  # when the latest round of probes ended
        self.round_time = 0.0  # the longest a round may take (a probe a target)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="shard-liveness", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def probe_once(self) -> None:
        watched = self.targets()
        alive = {pid for pid, _ in watched}
        for pid in [p for p in self.failing_since if p not in alive]:
            del self.failing_since[pid]  # exited, or its group was restarted or stopped
        for pid, socket_path in watched:
            asked = self.clock()
            if self.probe(socket_path, self.probe_timeout):
                self.failing_since.pop(pid, None)
            else:
                self.failing_since.setdefault(pid, asked)
        self.round_time = self.probe_timeout * len(watched)
        self.last_round = self.clock()

    def silent_for(self, pid: int) -> float | None:
        """Seconds `pid` has failed every probe, once past the timeout; else None.

        Silence is only what probes saw: while the probing itself lags (this launcher stopped, its
        container paused), nobody is judged."""
        since = self.failing_since.get(pid)
        if since is None or self.clock() - self.last_round > 2 * self.every + self.round_time:
            return None
        silence = self.clock() - since
        return silence if silence > self.timeout else None

    def _run(self) -> None:
        while not self.stopping.wait(self.every):
            try:
                self.probe_once()
            except Exception:  # a probe's own failure must not end the watching
                log.exception("probing the shards failed")
