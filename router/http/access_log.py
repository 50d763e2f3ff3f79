"""The access log: one line per HTTP request, once it is answered.

A stream's line comes once it ends, or once its client went away; lines go to the logger
"tgi.access", and every answer carries the request's id.

    POST /generate 200 0.412s input_tokens=5 generated_tokens=20 model=smollm2 request_id=9f2c...

The id is the client's `x-request-id` when it sends a usable one, else a new one; it comes back
in the answer's `x-request-id`. Tokens appear where the request generated, the adapter where one
was used. In JSON (--json-output) the same fields are the record's own keys. Probes (/health and
/metrics) log at DEBUG unless they fail: probes and scrapers would fill the log.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from router.telemetry.request_record import RequestRecord, make_current, reset_current

log = logging.getLogger("tgi.access")

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LENGTH = 128
_PROBE_PATHS = {"/health", "/metrics"}
_RECORD = web.RequestKey("access_record", RequestRecord)
_PREPARED_STATUS = web.RequestKey("access_prepared_status", int)  # the status sent, once sent
# a file's answer picks its status (304, 206, 416) as it is sent, after the handler returned: it
# is logged then, from the time its request began
_FILE_STARTED = web.RequestKey("access_file_started", float)
# nginx's status for a request whose client closed the connection before it was answered
CLIENT_CLOSED_REQUEST = 499
_MAX_PATH_LENGTH = 512


def request_id_of(request: web.Request) -> str:
    """The request's id: the client's when it is fit for a log line, else a new one.

    Fit: 1-128 printable characters without spaces, since it goes into log lines as it is."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(given) <= MAX_REQUEST_ID_LENGTH and all("!" <= c <= "~" for c in given):
        return given
    return uuid.uuid4().hex


def install(app: web.Application) -> None:
    """Installs the access log as the outermost middleware.

    Outermost middleware (it sees the answers error_middleware makes of errors, the API key's
    401s and CORS preflights) and the id on every answer as its headers go out."""
    app.middlewares.insert(0, access_log_middleware)
    app.on_response_prepare.append(_add_request_id)


@web.middleware
async def access_log_middleware(request: web.Request, handler):
    record = RequestRecord(request_id_of(request))
    request[_RECORD] = record
    token = make_current(record)
    started = time.monotonic()
    status = 500  # what aiohttp answers for an exception that no middleware turned into one
    is_client_gone = False
    try:
        response = await handler(request)
        status = response.status
        if isinstance(response, web.FileResponse) and not response.prepared:
            request[_FILE_STARTED] = started
        return response
    except web.HTTPException as err:  # a redirect, or an app without error_middleware
        status = err.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        # a stream's status went out with its headers; a request unanswered has none
        prepared = request.get(_PREPARED_STATUS)
        status = prepared if prepared is not None else CLIENT_CLOSED_REQUEST
        is_client_gone = True
        raise
    finally:
        reset_current(token)
        if _FILE_STARTED not in request:
            log_request(request, record, status, time.monotonic() - started,
                        is_client_gone=is_client_gone)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    record = request.get(_RECORD)
    if record is not None:
        response.headers[REQUEST_ID_HEADER] = record.request_id
        request[_PREPARED_STATUS] = response.status
        started = request.get(_FILE_STARTED)
        if started is not None:
            log_request(request, record, response.status, time.monotonic() - started)


def log_request(request: web.Request, record: RequestRecord, status: int, duration: float, *,
                is_client_gone: bool = False) -> None:
    # the path as sent, without the query: percent-escapes stay escaped, so no line breaks
    path = request.rel_url.raw_path[:_MAX_PATH_LENGTH]
    fields = {"method": request.method, "path": path, "status": status,
              "duration_s": round(duration, 6), "request_id": record.request_id}
    words = [request.method, path, str(status), f"{duration:.3f}s"]
    if record.num_generations:
        fields.update(input_tokens=record.input_tokens, generated_tokens=record.generated_tokens)
    if record.model is not None:
        fields["model"] = record.model
    if record.adapter_id is not None:
        fields["adapter"] = record.adapter_id
    if record.error_type is not None and status < 400:
        fields["error_type"] = record.error_type  # a stream's error, after its 200
    if is_client_gone:
        fields["client_gone"] = True
    words += [f"{key}={fields[key]}" for key in ("input_tokens", "generated_tokens", "model",
                                                 "adapter", "error_type", "client_gone",
                                                 "request_id") if key in fields]
    is_probe = path in _PROBE_PATHS and status < 400
    log.log(logging.DEBUG if is_probe else logging.INFO, "%s", " ".join(words), extra=fields)
