"""Failure fan-out: who hears of a failure and what each request lets go of.

A request's own failure (the shards refused it, its message could not be built, its generation
could not be read) reaches that request alone; a failed step reaches the requests in it; a lost
shard group sends the requests that received nothing back to the queue, once. No I/O here: the
scheduler decides what failed and clears the shards' batches itself.
"""
from __future__ import annotations

import logging

from router.errors import GenerationError, RouterError, SlowReaderError
from router.scheduler.active_request import ActiveRequest
from router.scheduler.request_queue import RequestQueue
from router.scheduler.running_requests import RunningRequests
from router.shards.step_types import Rejection, RequestFailedInShard
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router.failures")


class FailureFanOut:
    def __init__(self, running: RunningRequests, queue: RequestQueue[ActiveRequest],
                 metrics: Metrics):
        self.running = running
        self.queue = queue
        self.metrics = metrics

    def rejected(self, rejection: Rejection) -> None:
        """A request the step did not take: it fails, its blocks are freed, the others go on."""
        item = self.running.get(rejection.request_id)
        if item is None:
            return
        if rejection.error is None:
            log.warning("the shards refused request %d: %s", item.id, rejection.reason)
        self._tell(item, GenerationError(rejection.reason))
        self.running.release(item.id)

    def generation_failed(self, item: ActiveRequest, err: Exception) -> None:
        """A request whose generation failed in the shard or could not be read back: it fails now.

        The shard ended it as one it cannot go on with, or its generation could not be read
        back. The next filter drops it from the shards' batch and frees its blocks.
        """
        if isinstance(err, RequestFailedInShard):
            log.warning("the shards ended request %d: %s", item.id, err)
            self._tell(item, GenerationError(str(err)))
            return
        log.error("request %d failed while its generation was read back: %r", item.id, err,
                  exc_info=err)
        self._tell(item, GenerationError(f"{type(err).__name__}: {err}"))

    def reader_gone(self, item: ActiveRequest) -> None:
        """A request whose reader stopped taking its events (is_behind): it ends here.

        Its stream ends with a SlowReaderError after the events already queued, and the next
        filter drops it from the shards' batch and frees its blocks.
        """
        log.warning("request %d ended: its client left %d events unread", item.id,
                    item.events.qsize())
        self.metrics.counters.inc("tgi_request_failure", err="slow_reader")
        self._tell(item, SlowReaderError(
            f"the client stopped reading the stream ({item.events.qsize()} events unread): "
            "the generation was cancelled"))

    def fail(self, items: list[ActiveRequest], error: RouterError) -> None:
        """Each request hears `error` (unless it already ended) and lets go of its blocks."""
        for item in items:
            self._tell(item, error)
            self.running.release(item.id)

    def fail_running(self, error: RouterError) -> None:
        self.fail(self.running.all(), error)

    def fail_waiting(self, item: ActiveRequest, error: RouterError) -> None:
        """A request that left the queue without running."""
        self._tell(item, error)
        self.metrics.queue_size.set(len(self.queue))

    def shards_lost(self, error: RouterError, *, max_attempts: int, may_retry: bool) -> None:
        """The shard group is gone with every batch: some requests go back to the queue.

        The requests that received nothing go back to the front of the queue (at most
        `max_attempts` runs in all: one that kills the shards each time must not use up
        their restarts); the others hear `error`.
        """
        retry = [item for item in self.running.all()
                 if may_retry and item.is_live and item.delivered == 0
                 and item.attempts < max_attempts]
        for item in retry:
            self.running.drop(item.id)
        self.fail_running(error)
        self.queue.put_back(retry)
        self.metrics.queue_size.set(len(self.queue))

    @staticmethod
    def _tell(item: ActiveRequest, error: RouterError) -> None:
        if not item.is_done:
            item.events.put_nowait(error)
        item.is_done = True
