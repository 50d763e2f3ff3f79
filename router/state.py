"""What a running router holds, as every API module sees it (`request.app[STATE]`): its settings and
the models it serves; `served_model(request)` is the running model a request names."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from router.config import RouterConfig
from router.lifecycle.manager import ModelManager
from router.lifecycle.served_model import ServedModel

# names the model of a request whose body cannot (TGI's, SGLang's and generate-one's routes)
MODEL_HEADER = "X-Model-Id"


@dataclass
class RouterState:
    config: RouterConfig
    models: ModelManager
    tasks: list[asyncio.Task] = field(default_factory=list)
    # set when a batching loop dies: the process must exit rather than leave requests hanging
    fatal: asyncio.Event = field(default_factory=asyncio.Event)

    def served(self, name: str | None) -> ServedModel:
        return self.models.served_model(name)


STATE = web.AppKey("state", RouterState)


def served_model(request: web.Request, name: str | None = None) -> ServedModel:
    """The running model `name` (an OpenAI body's `model`) or, without one, the X-Model-Id
    header names; the default model when neither does. 404 or 409 in the caller's error shape."""
    if name is None:
        name = request.headers.get(MODEL_HEADER)
    return request.app[STATE].served(name)
