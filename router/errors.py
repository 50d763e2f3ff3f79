"""The router's errors, all of them: each knows its HTTP status and TGI error_type; below them, the
body each API answers an error in, and the gRPC status each maps to."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from aiohttp import web


class RouterError(Exception):
    status = 500
    error_type = "internal"
    prefix = ""
    param: str | None = None  # the request field at fault, where known (OpenAI's error `param`)
    headers: dict[str, str] = {}  # sent with the error's HTTP answer
    # the connection cannot serve another request after this answer (a body aiohttp cannot read)
    close_connection = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.prefix}{self.message}"


# the field a validation message opens with, as the router's do where one field is at fault:
# "`temperature` must be ...", "messages[2].role must be ...", "tools[0]: ..."
_LEADING_FIELD = re.compile(r"`([^`\s]+)`|([a-z_]+\[\d+\][\w.\[\]]*)")


class ValidationError(RouterError):
    """`param`: the field at fault; by default the one the message opens with, if any."""

    status = 422
    error_type = "validation"
    prefix = "Input validation error: "

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        leading = _LEADING_FIELD.match(message)
        self.param = param or (leading and (leading[1] or leading[2]))


@contextmanager
def about_field(param: str) -> Iterator[None]:
    """ValidationErrors raised inside it are about `param`: an OpenAI route's name for a check
    worded in TGI's (`inputs`, `max_new_tokens`)."""
    try:
        yield
    except ValidationError as err:
        err.param = param
        raise


class UnknownAdapterError(ValidationError, LookupError):
    """A request names a LoRA adapter the model has not loaded (or is unloading). A 422 as it
    is; the OpenAI and SGLang routes answer it in their own status."""

    def __init__(self, name: str, loaded: list[str]):
        listed = (f"the loaded adapters are: {', '.join(loaded)}" if loaded
                  else "no LoRA adapters are loaded")
        super().__init__(f"adapter {str(name)[:200]!r} is not loaded; {listed}")
        self.adapter = name


class AdapterError(RouterError):
    """A LoRA adapter cannot be loaded or unloaded as asked: a bad directory, a name in use, an
    adapter the shards refuse (the message says which). 400, as vLLM answers them."""

    status = 400
    error_type = "adapter"

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status  # 424 when the shards failed the call rather than refused it


class OverloadedError(RouterError):
    status = 429
    error_type = "overloaded"
    # a slot frees when any request in flight ends: worth trying again soon
    headers = {"Retry-After": "1"}

    def __init__(self, message: str = "Model is overloaded"):
        super().__init__(message)


class GenerationError(RouterError):
    status = 424
    error_type = "generation"
    prefix = "Request failed during generation: Server error: "


class IncompleteGenerationError(RouterError):
    status = 500
    error_type = "incomplete_generation"

    def __init__(self, message: str = "Incomplete generation"):
        super().__init__(message)


class UnhealthyError(RouterError):
    status = 503
    error_type = "healthcheck"
    # a restart of the shards takes seconds (loading the model, warming up)
    headers = {"Retry-After": "5"}

    def __init__(self, message: str = "unhealthy"):
        super().__init__(message)


class AuthenticationError(RouterError):
    """--api-key is set and the request does not carry it."""

    status = 401
    error_type = "authentication"

    def __init__(self):
        super().__init__("Unauthorized: a valid 'Authorization: Bearer <key>' header is required")


class HTTPError(RouterError):
    """aiohttp's own refusals (no such route, a method the route does not take)."""

    error_type = "http"

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class PayloadTooLargeError(RouterError):
    status = 413
    error_type = "payload_limit"
    prefix = "Payload too large: "


class RequestTimeoutError(RouterError):
    status = 408
    error_type = "timeout"


class BadRequestError(RouterError):
    """Malformed bodies: invalid JSON or wrong field types; TGI's clients read them as validation."""

    status = 422
    error_type = "validation"


class TemplateError(RouterError):
    status = 422
    error_type = "template_error"
    prefix = "Template error: "


class SessionBusyError(RouterError):
    """A generate-one call on a request_id whose previous call is still running."""

    status = 409
    error_type = "session_busy"


class ModelNotFoundError(RouterError):
    status = 404
    error_type = "model_not_found"


class ModelStateError(RouterError):
    """A move the state machine does not allow (starting a model that is downloading, ...)."""

    status = 409
    error_type = "model_state"

    def __init__(self, message: str, state: str):
        super().__init__(message)
        self.state = state


class InvalidModelIdError(RouterError):
    status = 400
    error_type = "invalid_model_id"


class ModelStartError(RouterError):
    """The model's shards could not be started or warmed up (the reason is the message)."""

    status = 424
    error_type = "model_start"


class ModelHostMissingError(RouterError):
    status = 503
    error_type = "model_host"

    def __init__(self, reason: str = "this router runs without tgi-launcher's model host"):
        super().__init__(f"models cannot be pulled, started or stopped: {reason}")


# -- the body of an error in each API's shape

def tgi_error_body(error: RouterError) -> dict:
    """TGI's `{"error", "error_type"}`: TGI's routes, generate-one's, and every route by default."""
    return {"error": str(error), "error_type": error.error_type}


def openai_stream_error_body(error: RouterError) -> dict:
    """The last `data:` frame of an OpenAI stream that failed after it opened."""
    return {"error": {"message": str(error), "type": error.error_type,
                      "http_status_code": error.status}}


def _openai_error_type(status: int) -> str:
    """OpenAI's `type` for an error of this HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_exceeded"
    if status < 500 and status != 424:  # 424: a shard failed the generation, not the request
        return "invalid_request_error"
    return "server_error"


def openai_error_body(error: RouterError) -> dict:
    """OpenAI's error object, for OpenAI's SDKs on the /v1 routes: their exceptions' text is
    `message`, and they expose type, param and code. `code` is TGI's error_type (OpenAI's own
    `model_not_found` among them), so an SDK reads all that TGI's shape says."""
    return {"error": {"message": str(error), "type": _openai_error_type(error.status),
                      "param": error.param, "code": error.error_type}}


def sglang_error_body(error: RouterError) -> dict:
    return {"error": {"message": str(error), "type": error.error_type, "code": error.status}}


def models_error_body(error: RouterError) -> dict:
    """The model routes': TGI's fields, and a 409 names the model's current state."""
    body = tgi_error_body(error)
    if isinstance(error, ModelStateError):
        body["state"] = error.state
    return body


# a handler of another API's shape sets request[ERROR_BODY] to its own body function, which the
# error middleware then uses for what the handler lets through (TGI's shape otherwise; an OpenAI
# SDK on a /v1 route gets openai_error_body whatever the route: router.http.middleware)
ERROR_BODY = web.RequestKey("error_body", Callable[[RouterError], dict])


# -- the public gRPC API's statuses

# TGI's HTTP status -> gRPC code. 424 (a shard failed during the generation) is INTERNAL, not
# UNAVAILABLE: clients and proxies retry UNAVAILABLE on their own, and a request that crashed the
# shards would crash the restarted group again. 503 is UNAVAILABLE: the shards are restarting or
# the server is shutting down, so trying again later (Retry-After in the trailers) is right.
GRPC_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
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
    return GRPC_STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def grpc_error_trailers(error: RouterError) -> tuple[tuple[str, str], ...]:
    """TGI's error_type, and the HTTP answer's headers (Retry-After), as trailing metadata."""
    return (("tgi-error-type", error.error_type),
            *((name.lower(), value) for name, value in error.headers.items()))
