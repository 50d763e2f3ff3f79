"""Trace spans of one HTTP request: the request, its validation, its time queued and in batches."""
from __future__ import annotations

import time
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from proto.tracing import extract_headers, tracer, tracing_enabled
from router.schemas import Timings

_TRACER = tracer("tgi.router")


@contextmanager
def request_span(name: str, headers):
    """The request's span, child of the caller's `traceparent` if it sent one; None when off."""
    if not tracing_enabled():
        yield None
        return
    with _TRACER.start_as_current_span(name, context=extract_headers(headers),
                                       kind=SpanKind.SERVER) as span:
        yield span


@contextmanager
def phase_span(name: str):
    if not tracing_enabled():
        yield
        return
    with _TRACER.start_as_current_span(name):
        yield


def current_span_context():
    return trace.get_current_span().get_span_context() if tracing_enabled() else None


def record_phases(timings: Timings) -> None:
    """Queue and inference spans under the current request span.

    Written once the request ended (their times are known only then)."""
    if not tracing_enabled():
        return
    span = trace.get_current_span()
    offset_ns = time.time_ns() - time.monotonic_ns()
    parent = trace.set_span_in_context(span)
    for name, start, end in (("queue", timings.queued_at, timings.batched_at),
                             ("inference", timings.batched_at, timings.finished_at)):
        if start and end:
            child = _TRACER.start_span(name, context=parent, start_time=int(start * 1e9) + offset_ns)
            child.end(end_time=int(end * 1e9) + offset_ns)
