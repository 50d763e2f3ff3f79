"""What a running router holds, as every API module sees it: its settings and the models it serves.

`request.app[STATE]` is the RouterState; `served_model(request)` is the running model a request
names.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from router.config.server import ServerSettings
from router.errors import ModelNotFoundError
from router.lifecycle.manager import UNNAMED_MODELS, ModelManager
from router.lifecycle.served_model import ServedModel
from router.telemetry.request_record import current_record

# names the model of a request whose body cannot (TGI's, SGLang's and generate-one's routes)
MODEL_HEADER = "X-Model-Id"


@dataclass
class RouterState:
    """The router's settings, its models, and its own tasks."""

    config: ServerSettings
    models: ModelManager
    tasks: list[asyncio.Task] = field(default_factory=list)
    # set when a batching loop dies: the process must exit rather than leave requests hanging
    fatal: asyncio.Event = field(default_factory=asyncio.Event)

    def served(self, name: str | None) -> ServedModel:
        return self.models.served_model(name)


STATE = web.AppKey("state", RouterState)


def served_model(request: web.Request, name: str | None = None) -> ServedModel:
    """The running model `name` (an OpenAI body's `model`) or, without one, X-Model-Id names.

    The default model when neither does; 404 or 409 in the caller's error shape.
    """
    if name is None:
        name = request.headers.get(MODEL_HEADER)
    return _noted(request.app[STATE].served(name))


def _noted(served: ServedModel) -> ServedModel:
    """`served`, named in the access log's record of the request."""
    record = current_record()
    if record is not None:
        record.model = served.model_name
    return served


def model_and_adapter(request: web.Request, name: str | None) -> tuple[ServedModel, str | None]:
    """The model and LoRA adapter an OpenAI body's `model` names.

    A LoRA adapter's name gives its base model and the adapter (models and adapters share one
    namespace); any other name is served_model's, with no adapter.
    """
    models = request.app[STATE].models
    found = models.adapter_model(name)
    if found is not None:
        return _noted(found[0]), found[1]
    served = served_model(request, name)
    loaded = served.adapters.names()
    # while one model runs any name reaches it, as in TGI; but once it serves adapters, a name
    # that is neither the model nor one of them is most likely a mistyped adapter, whose answer
    # from the base model would read like the adapter's
    if loaded and name not in UNNAMED_MODELS and name not in models.served:
        raise ModelNotFoundError(f"model {str(name)[:200]!r} not found: neither the model "
                                 f"{served.model_name!r} nor one of its LoRA adapters "
                                 f"({', '.join(loaded)})")
    return served, None
