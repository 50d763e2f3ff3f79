"""Server-Sent Events framing and the response that carries them."""
from __future__ import annotations

import json

from aiohttp import web


def sse_data(payload: dict | str, *, openai: bool = False) -> bytes:
    """One event. TGI's routes write `data:{...}`; OpenAI's write `data: {...}` and end with
    `data: [DONE]`, which some clients compare byte for byte."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n".encode() if openai else f"data:{data}\n\n".encode()


def openai_sse(payload: dict | str) -> bytes:
    return sse_data(payload, openai=True)


async def open_sse(request: web.Request, headers: dict | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **(headers or {})})
    await response.prepare(request)
    return response
