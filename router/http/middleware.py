"""HTTP middlewares: errors in the {error, error_type} envelope, API key, CORS."""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from router.errors import ERROR_BODY, PayloadTooLargeError, RouterError, tgi_error_body

log = logging.getLogger("tgi.router")

# open without a key, as in TGI: probes and scrapers carry no credentials
_PUBLIC_PATHS = {"/health", "/metrics"}


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
        return web.json_response({"error": err.reason, "error_type": "http"}, status=err.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(request, RouterError("Internal server error"))


def _error_response(request: web.Request, err: RouterError) -> web.Response:
    """`err` in the error body of the route's API (request[ERROR_BODY], TGI's by default)."""
    body = request.get(ERROR_BODY, tgi_error_body)
    return web.json_response(body(err), status=err.status, headers=err.headers)


def api_key_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        if request.path in _PUBLIC_PATHS or request.method == "OPTIONS":
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized: a valid 'Authorization: Bearer <key>' "
                                               "header is required", "error_type": "authentication"},
                                     status=401)
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
