"""Trace context across the router↔shard contract: OTLP export and W3C traceparent in gRPC metadata.

Both sides of the contract use it, so it lives with the contract. Without an endpoint nothing is
exported and every helper is a cheap no-op.
"""
from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_provider = None


def init_tracing(service_name: str, endpoint: str | None) -> bool:
    """Exports spans over OTLP/gRPC to `endpoint`; returns whether tracing is on."""
    global _provider
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                     insecure=True)))
    trace.set_tracer_provider(_provider)
    return True


def tracing_enabled() -> bool:
    return _provider is not None


def shutdown_tracing() -> None:
    """Flushes spans still buffered; call before the process exits."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_metadata(span_context: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current (or given) span as `traceparent`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_context)
    return list(carrier.items())


def extract_metadata(metadata) -> otel_context.Context:
    """The parent context sent by the caller, from gRPC invocation metadata."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)


def extract_headers(headers) -> otel_context.Context:
    """The parent context of an incoming HTTP request (its traceparent header), if any."""
    return _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
