"""The router's error family: each error knows its HTTP status and TGI error_type; one function per API
family turns it into that API's body."""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


class RouterError(Exception):
    status = 500
    error_type = "internal"
    prefix = ""
    headers: dict[str, str] = {}  # sent with the error's HTTP answer
    # the connection cannot serve another request after this answer (a body aiohttp cannot read)
    close_connection = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.prefix}{self.message}"


class ValidationError(RouterError):
    status = 422
    error_type = "validation"
    prefix = "Input validation error: "


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


def tgi_error_body(error: RouterError) -> dict:
    return {"error": str(error), "error_type": error.error_type}


# a handler of another API's shape sets request[ERROR_BODY] to its own body function, which the
# error middleware then uses for what the handler lets through (TGI's shape otherwise)
ERROR_BODY = web.RequestKey("error_body", Callable[[RouterError], dict])


class TemplateError(RouterError):
    status = 422
    error_type = "template_error"
    prefix = "Template error: "
