"""OpenTelemetry: router and shard spans reach a real OTLP gRPC receiver, shard spans under the router's."""
from concurrent import futures

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.e2e.server import free_port, launch

pytestmark = pytest.mark.e2e


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []  # (service name, span)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_shard_spans_are_children_of_the_router_spans(tiny_llama, tmp_path, receiver):
    collector, endpoint = receiver
    server = launch(["--model-id", str(tiny_llama)], tmp_path,
                    extra=["--max-batch-total-tokens", "4096", "--otlp-endpoint", endpoint,
                           "--otlp-service-name", "tgi-test"])
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        reply = requests.post(f"{server.url}/generate", timeout=60,
                              headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                              json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert reply.status_code == 200
    finally:
        assert server.stop() == 0  # stopping flushes the exporters
    spans = {span.span_id: (service, span) for service, span in collector.spans}
    by_name = {}
    for service, span in spans.values():
        by_name.setdefault((service, span.name), []).append(span)

    (request_span,) = by_name[("tgi-test", "generate")]
    assert request_span.trace_id.hex() == trace_id, "the caller's traceparent is the parent"
    for phase in ("validation", "queue", "inference"):
        (child,) = by_name[("tgi-test", phase)]
        assert child.parent_span_id == request_span.span_id
    for method in ("prefill", "decode"):
        router_steps = by_name[("tgi-test", method)]
        shard_steps = by_name[("tgi-test.shard", method)]
        assert len(shard_steps) == len(router_steps)
        router_ids = {s.span_id for s in router_steps}
        for shard_span in shard_steps:
            assert shard_span.parent_span_id in router_ids
        for router_step in router_steps:
            assert any(link.span_id == request_span.span_id for link in router_step.links)
