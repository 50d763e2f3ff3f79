"""One request from submission to its last event.

What the queue plans with, plus what the API side reads (`events`) and the marks the scheduler
leaves on it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import SpanContext

from router.scheduler.request_queue import QueueEntry
from router.schemas import FinalInfo, GenerateRequest, TokenEvent

log = logging.getLogger("tgi.router.active_request")


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
    generated_ids: list[int] = field(default_factory=list)
    # called with the final event's info as it is delivered, while the request still holds its
    # blocks (a session keeps them); an exception there is the hook's, never the loop's
    on_final: Callable[["ActiveRequest", FinalInfo], None] | None = None
    # events its reader may leave unread from one step to the next before it counts as gone
    # (0: no bound); see is_behind
    max_unread_events: int = 0

    @property
    def is_live(self) -> bool:
        return not self.is_done and not self.is_cancelled

    @property
    def is_behind(self) -> bool:
        """Its reader left `max_unread_events` events unread since the last steps.

        Asked as a step's events arrive, before they are delivered: a reader that keeps up has
        taken the earlier ones while the shards computed this step, so only one that stopped
        reading (a client whose connection takes nothing more) falls this far behind, and
        without the bound its events would pile up in the router until its generation ended.
        """
        return 0 < self.max_unread_events <= self.events.qsize()


def deliver(item: ActiveRequest, event: TokenEvent) -> None:
    """Hands one event to the API side; the last one ends the request."""
    item.generated_ids.append(event.token.id)
    if event.final is not None:
        if event.final.token_ids is not None:  # sent whole at the end (beam search)
            item.generated_ids = list(event.final.token_ids)
        item.is_done = True
        if item.on_final is not None:
            try:
                item.on_final(item, event.final)
            except Exception:
                log.exception("the final hook of request %d failed", item.id)
    item.delivered += 1
    item.events.put_nowait(event)
