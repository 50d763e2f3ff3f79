"""Ollama's error body, `{"error": "..."}`."""
from __future__ import annotations

import functools

from aiohttp import web

from router.errors import BadRequestError, RouterError, TemplateError, ValidationError
from router.http.middleware import ERROR_BODY


class OllamaBadRequest(RouterError):
    """A request Ollama would refuse: its 400 (our other APIs answer these with 422s)."""

    status = 400
    error_type = "validation"


def ollama_error_body(error: RouterError) -> dict:
    """Ollama's error object: the message alone (its clients read `error` and the status)."""
    return {"error": str(error)}


def ollama_route(handler):
    """A route whose errors are Ollama's: `{"error"}` bodies, and 400 for a bad request."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        request[ERROR_BODY] = ollama_error_body
        try:
            return await handler(request)
        except (ValidationError, BadRequestError, TemplateError) as err:
            raise OllamaBadRequest(str(err), close_connection=err.close_connection) from None
    return wrapped
