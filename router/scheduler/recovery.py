"""Waiting out a restart of the shard group: reconnect, warm up, start the KV accounting afresh.

The launcher restarts every rank when one dies (collectives need all of them); the router only sees
its calls fail. While the shards are away the router stays up: /health answers 503, waiting and new
requests stay queued until the shards are back or their wait passes `timeout` (then 503), and the
KV pool is sized again from the new shards' warm-up, since their caches started empty. Embedding
inputs wait on the same recovery and bound (router/core/embedding.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.errors import RouterError, UnhealthyError
from router.scheduler.active_request import ActiveRequest
from router.scheduler.request_queue import RequestQueue
from router.scheduler.running_requests import RunningRequests

log = logging.getLogger("tgi.router.recovery")

# how often a waiting router tries the shards' sockets again
RETRY_INTERVAL_S = 0.5


@dataclass(slots=True)
class RecoveryPolicy:
    # connects to the restarted group and warms it up; returns the new KV pool's block count
    reconnect: Callable[[], Awaitable[int]]
    # whether the group the router is connected to still answers, with the same processes
    is_alive: Callable[[], Awaitable[bool]]
    timeout: float  # seconds a request waits in the queue for the shards before a 503
    # a request that a shard failure sent back to the queue runs again at most this often: one
    # that kills the shards every time must not exhaust the launcher's restart budget
    max_attempts: int = 2


def shards_unavailable(waited: float) -> UnhealthyError:
    return UnhealthyError(f"the model shards are restarting and did not come back within "
                          f"{waited:.0f} s; try again later")


def shutting_down() -> UnhealthyError:
    # the server stopping, or this model alone (stopped, or its restarts used up)
    return UnhealthyError("the model is being stopped while its shards restart")


class ShardRecovery:
    def __init__(self, policy: RecoveryPolicy, queue: RequestQueue[ActiveRequest],
                 running: RunningRequests, fail_waiting: Callable[[ActiveRequest, RouterError], None]):
        self.policy = policy
        self.queue = queue
        self.running = running
        self.fail_waiting = fail_waiting
        self.healthy = True
        self.lost_since: float | None = None  # monotonic time the shards were found lost
        # the router is shutting down: nothing waits for the shards any more
        self.stopping = False
        self.restarts = 0  # losses of the group that ended with it back
        self._back = asyncio.Event()  # set, and replaced, each time the group is back

    async def is_lost(self) -> bool:
        """Whether the group no longer answers, or answers with other processes.

        Asked twice: one slow answer must not cost a warm-up and the prefix cache.
        """
        is_alive = self.policy.is_alive
        return not await is_alive() and not await is_alive()

    def stop(self) -> None:
        """The router is stopping: requests queued for shards that are not there get a 503 now.

        They would never run; so do those of a loss found later, instead of holding the
        shutdown until its grace period ends. With the shards there, queued requests drain.
        """
        self.stopping = True
        if not self.healthy:
            self._expire_waiting(time.monotonic())

    async def wait_for_shards(self) -> None:
        """Blocks until the shards are back and warmed up; requests that wait too long get 503."""
        self.healthy = False
        started = self.lost_since = time.monotonic()
        log.warning("lost the shards; waiting for them to restart")
        while True:
            self._expire_waiting(started)
            try:
                # bounded: a warm-up that hangs must not hold the waiting requests past their time
                num_blocks = await asyncio.wait_for(self.policy.reconnect(), self.policy.timeout)
                break
            except Exception as err:  # still restarting, or warming up failed: try again
                log.debug("shards not back yet: %s", err)
                await asyncio.sleep(RETRY_INTERVAL_S)
        self.running.reset_pool(num_blocks)
        self.healthy, self.lost_since = True, None
        self.restarts += 1
        self._back.set()
        self._back = asyncio.Event()
        log.warning("shards are back after %.1f s (KV pool: %d blocks)",
                    time.monotonic() - started, num_blocks)

    async def back(self, since: int, within: float) -> None:
        """Returns once the group is back from a loss after `since` restarts, or in `within` s."""
        if self.restarts != since:
            return
        try:
            await asyncio.wait_for(self._back.wait(), within)
        except asyncio.TimeoutError:
            pass

    def waiting_error(self, queued_at: float, recovery_started: float,
                      now: float) -> RouterError | None:
        """The 503 a request queued at `queued_at` gets now for want of shards; None: it waits on.

        Its wait counts from when it was queued or the shards were lost, whichever is later."""
        if self.stopping:
            return shutting_down()
        waited = now - max(queued_at, recovery_started)
        return shards_unavailable(waited) if waited > self.policy.timeout else None

    def _expire_waiting(self, recovery_started: float) -> None:
        now = time.monotonic()
        for entry in self.queue.entries():
            error = self.waiting_error(entry.queued_at, recovery_started, now)
            if error is not None and self.queue.remove(entry):
                self.fail_waiting(entry, error)
