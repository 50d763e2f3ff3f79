"""HTTP middlewares: errors answered in each API's body, the API key, CORS.

The bodies are the API packages' (router/api/*/errors.py), given by whoever builds the
application (router/app.py): this layer sits below them and imports none.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from router.errors import AuthenticationError, HTTPError, PayloadTooLargeError, RouterError

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


ErrorBody = Callable[[RouterError], dict]
# a handler of an API with its own error body sets request[ERROR_BODY] to it, and the error
# middleware answers what the handler lets through in it
ERROR_BODY = web.RequestKey("error_body", ErrorBody)


@dataclass(frozen=True, slots=True)
class ErrorBodies:
    """Which body an error is answered in: an override's, the handler's, else the default.

    `overrides` are (test of the request, body) pairs that win over the route's own body, such as
    OpenAI's for an OpenAI SDK on any /v1 route."""

    default: ErrorBody
    overrides: tuple[tuple[Callable[[web.Request], bool], ErrorBody], ...] = ()

    def response(self, request: web.Request, err: RouterError) -> web.Response:
        """`err` answered in the body that fits the request."""
        body = next((body for applies, body in self.overrides if applies(request)),
                    request.get(ERROR_BODY, self.default))
        return web.json_response(body(err), status=err.status, headers=err.headers)


def error_middleware(bodies: ErrorBodies):
    """A middleware answering every error a handler raises in the body `bodies` picks."""

    @web.middleware
    async def answer_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except RouterError as err:
            response = bodies.response(request, err)
            if err.close_connection:
                response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge as err:
            return bodies.response(request, PayloadTooLargeError(err.text))
        except web.HTTPException as err:
            if err.status < 400:
                raise
            return bodies.response(request, HTTPError(err.reason, err.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return bodies.response(request, RouterError("Internal server error"))

    return answer_errors


def api_key_middleware(api_key: str, bodies: ErrorBodies, *,
                       private_headers: tuple[str, ...] = ()):
    """A middleware refusing, with a 401 in the body `bodies` picks, a request without the key.

    A public route answers without the key, but as if `private_headers` were absent: they choose
    what answers (X-Model-Id, a model), and what each choice says (404, a stopped model's 503)
    would tell a caller without the key which models exist and in which state."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return await handler(request)
        if not _is_public(request):
            return bodies.response(request, AuthenticationError())
        if any(name in request.headers for name in private_headers):
            headers = request.headers.copy()
            for name in private_headers:
                headers.popall(name, None)
            request = request.clone(headers=headers)
        return await handler(request)

    return check_key


def install_cors(app: web.Application, allowed: str) -> None:
    """Installs CORS: preflights answered, and headers on every allowed answer.

    A middleware answers preflights; it is outermost, so that a preflight needs no key. The headers
    go on every answer to an allowed origin as it is prepared (on_response_prepare): a stream's too,
    whose headers go out before its handler returns."""
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
