"""The gRPC status and trailing metadata each router error ends a public gRPC call with."""
from __future__ import annotations

import grpc

from router.errors import NotServedError, RouterError

# TGI's HTTP status -> gRPC code. 424 (a shard failed during the generation) is INTERNAL, not
# UNAVAILABLE: clients and proxies retry UNAVAILABLE on their own, and a request that crashed the
# shards would crash the restarted group again. 503 is UNAVAILABLE: the shards are restarting or
# the server is shutting down, so trying again later (Retry-After in the trailers) is right.
GRPC_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    424: grpc.StatusCode.INTERNAL,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


def grpc_status_code(error: RouterError) -> grpc.StatusCode:
    """The gRPC code of the error's HTTP status (INTERNAL for one not in the table).

    A model asked for what it does not do (embeddings of one that only generates, the reverse,
    a Matryoshka prefix of one that has none) is FAILED_PRECONDITION: the request is well formed,
    the model is not one that serves it."""
    if isinstance(error, NotServedError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return GRPC_STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def grpc_error_trailers(error: RouterError) -> tuple[tuple[str, str], ...]:
    """TGI's error_type, and the HTTP answer's headers (Retry-After), as trailing metadata."""
    return (("tgi-error-type", error.error_type),
            *((name.lower(), value) for name, value in error.headers.items()))
