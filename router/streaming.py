"""Server-Sent Events framing and the response that carries them."""
from __future__ import annotations

import json

from aiohttp import web


def sse_data(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data:{data}\n\n".encode()


async def open_sse(request: web.Request, headers: dict | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **(headers or {})})
    await response.prepare(request)
    return response
