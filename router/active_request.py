"""One request from submission to its last event: what the queue plans with, plus what the API
side reads (`events`) and the marks the scheduler leaves on it."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry.trace import SpanContext

from router.request_queue import QueueEntry
from router.schemas import GenerateRequest, TokenEvent


@dataclass(slots=True, kw_only=True)
class ActiveRequest(QueueEntry):
    request: GenerateRequest
    # TokenEvents, then None or a RouterError; the API side's only channel
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_cancelled: bool = False  # the client went away
    is_done: bool = False  # its last event was sent (or it never will be)
    delivered: int = 0  # events sent to the API side
    batched_at: float = 0.0
    span_context: SpanContext | None = None  # the HTTP request's span, when tracing

    @property
    def is_live(self) -> bool:
        return not self.is_done and not self.is_cancelled


def deliver(item: ActiveRequest, event: TokenEvent) -> None:
    """Hands one event to the API side; the last one ends the request."""
    if event.final is not None:
        item.is_done = True
    item.delivered += 1
    item.events.put_nowait(event)
