"""HTTP middlewares: errors in each API's envelope (TGI's {error, error_type} by default),
API key, CORS."""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from router.errors import (ERROR_BODY, AuthenticationError, HTTPError, PayloadTooLargeError,
                           RouterError, openai_error_body, tgi_error_body)

log = logging.getLogger("tgi.router")

# open without a key, as in TGI: probes and scrapers carry no credentials
_PUBLIC_PATHS = {"/health", "/metrics"}
# the pages at / and /docs and their files (router/api/ui): a page must load before it can ask
# for the key. GET only: POST / is TGI's generate route
_PUBLIC_PAGES = {"/", "/docs"}
_PUBLIC_PAGE_PREFIXES = ("/ui/", "/docs/")


def _is_public(request: web.Request) -> bool:
    if request.path in _PUBLIC_PATHS or request.method == "OPTIONS":
        return True
    return request.method in ("GET", "HEAD") and (
        request.path in _PUBLIC_PAGES or request.path.startswith(_PUBLIC_PAGE_PREFIXES))


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RouterError as err:
        response = _error_response(request, err)
        if err.close_connection:
            response.force_close()
        return response
    except web.HTTPRequestEntityTooLarge as err:
        return _error_response(request, PayloadTooLargeError(err.text))
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return _error_response(request, HTTPError(err.reason, err.status))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(request, RouterError("Internal server error"))


def _error_response(request: web.Request, err: RouterError) -> web.Response:
    """`err` in OpenAI's error body to an OpenAI SDK on a /v1 route, else in the body of the
    route's API (request[ERROR_BODY], TGI's by default)."""
    body = openai_error_body if _is_openai_sdk(request) else request.get(ERROR_BODY, tgi_error_body)
    return web.json_response(body(err), status=err.status, headers=err.headers)


def _is_openai_sdk(request: web.Request) -> bool:
    """OpenAI's SDKs (Stainless-built) send x-stainless-* headers, and put only OpenAI's
    error.message in their exceptions' text; other clients of /v1 (TGI's, huggingface_hub)
    read TGI's {"error", "error_type"}."""
    return request.path.startswith("/v1/") and any(
        name.lower().startswith("x-stainless-") for name in request.headers)


def api_key_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        if _is_public(request):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _error_response(request, AuthenticationError())
        return await handler(request)

    return check_key


def install_cors(app: web.Application, allowed: str) -> None:
    """A middleware answering preflights, and CORS headers on every answer to an allowed origin
    as it is prepared (on_response_prepare): a stream's too, whose headers go out before its
    handler returns. Outermost, so that a preflight needs no key."""
    origins = {o.strip() for o in allowed.split(",") if o.strip()}

    def allow(origin: str | None) -> str | None:
        if origin is None:
            return None
        return origin if origin in origins or "*" in origins else None

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = allow(request.headers.get("Origin"))
        if origin:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE"
            # what the preflight asks for (browser SDKs send their own x- headers), else these
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "content-type, authorization")
            response.headers["Vary"] = "Origin"

    app.on_response_prepare.append(add_headers)

    @web.middleware
    async def cors(request: web.Request, handler):
        if request.method == "OPTIONS" and allow(request.headers.get("Origin")):
            return web.Response(status=204)
        return await handler(request)

    app.middlewares.insert(0, cors)
