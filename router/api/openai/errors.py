"""OpenAI's error bodies: the answer an OpenAI SDK reads, and a failed stream's last frame."""
from __future__ import annotations

from aiohttp import web

from router.errors import RouterError


def stream_error_body(error: RouterError, *, sdk: bool) -> dict:
    """The last `data:` frame of a /v1 stream that failed after it opened.

    TGI's {"error", "error_type"}, as TGI writes it on these routes (and huggingface_hub reads
    it); to an OpenAI SDK, OpenAI's error object, whose `message` its APIError raises (the SDK
    reads a string `error` as "An error occurred during streaming")."""
    if sdk:
        return openai_error_body(error)
    return {"error": str(error), "error_type": error.error_type}


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
    """OpenAI's error object, for OpenAI's SDKs on the /v1 routes.

    Their exceptions' text is `message`, and they expose type, param and code. `code` is TGI's
    error_type (OpenAI's own `model_not_found` among them), so an SDK reads all that TGI's shape
    says."""
    return {"error": {"message": str(error), "type": _openai_error_type(error.status),
                      "param": error.param, "code": error.error_type}}


def is_openai_sdk(request: web.Request) -> bool:
    """Whether an OpenAI SDK sent this request to a /v1 route.

    OpenAI's SDKs (Stainless-built) send x-stainless-* headers, and put only OpenAI's
    error.message in their exceptions' text; other clients of /v1 (TGI's, huggingface_hub)
    read TGI's {"error", "error_type"}."""
    return request.path.startswith("/v1/") and any(
        name.lower().startswith("x-stainless-") for name in request.headers)
