"""The router's typed errors: each knows its HTTP status and TGI error_type.

Each API answers them in its own body (router/api/*/errors.py); the public gRPC API maps them to
its statuses (router/api/grpc/status.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager


class RouterError(Exception):
    status = 500
    error_type = "internal"
    prefix = ""
    param: str | None = None  # the request field at fault, where known (OpenAI's error `param`)
    headers: dict[str, str] = {}  # sent with the error's HTTP answer
    # the connection cannot serve another request after this answer (a body aiohttp cannot read)
    close_connection = False

    def __init__(self, message: str, *, close_connection: bool = False):
        super().__init__(message)
        self.message = message
        if close_connection:
            self.close_connection = True

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

    def __init__(self, message: str, *, param: str | None = None, close_connection: bool = False):
        super().__init__(message, close_connection=close_connection)
        leading = _LEADING_FIELD.match(message)
        self.param = param or (leading and (leading[1] or leading[2]))

    def blame(self, param: str) -> None:
        """Names `param` as the field at fault, in place of the one found in the message."""
        self.param = param


@contextmanager
def about_field(param: str) -> Iterator[None]:
    """Inside it, ValidationErrors are about `param`.

    `param` is an OpenAI route's name for a check worded in TGI's (`inputs`, `max_new_tokens`)."""
    try:
        yield
    except ValidationError as err:
        err.blame(param)
        raise


class NotServedError(RouterError):
    """A model asked for what it does not do: embeddings of one that only generates, or the reverse."""

    status = 400
    error_type = "validation"

    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message)
        self.param = param


class UnknownAdapterError(ValidationError, LookupError):
    """A request names a LoRA adapter the model has not loaded (or is unloading).

    A 422 as it is; the OpenAI and SGLang routes answer it in their own status."""

    def __init__(self, name: str, loaded: list[str]):
        listed = (f"the loaded adapters are: {', '.join(loaded)}" if loaded
                  else "no LoRA adapters are loaded")
        super().__init__(f"adapter {str(name)[:200]!r} is not loaded; {listed}")
        self.adapter = name


class AdapterError(RouterError):
    """A LoRA adapter cannot be loaded or unloaded as asked (400, as vLLM answers).

    A bad directory, a name in use, an adapter the shards refuse (the message says which)."""

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


class SlowReaderError(RouterError):
    """A streamed answer whose client stopped taking it: the stream ends, its generation with it.

    408, as a client too slow to send its body gets; DEADLINE_EXCEEDED on the gRPC API."""

    status = 408
    error_type = "slow_reader"


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


class LocalPathRefusedError(RouterError):
    """A pull names a local path outside the directories the operator allows.

    One message for any such path, so that the answer tells nothing of what lies there."""

    status = 403
    error_type = "local_path_refused"
