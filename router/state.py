"""What a running router holds, as every API module sees it: its settings and the models it serves.

`request.app[STATE]` is the RouterState; `served_model(request)` is the running model a request
names.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from router.config.server import ServerSettings
from router.errors import ModelNotFoundError, ModelStateError, UnhealthyError
from router.inputs.images.sources import MediaLimits
from router.inputs.template_pool import TemplatePool
from router.lifecycle.local_paths import LocalRoots, split_paths
from router.lifecycle.manager import UNNAMED_MODELS, ModelManager
from router.lifecycle.served_model import ServedModel
from router.telemetry.request_record import current_record

# names the model of a request whose body cannot (TGI's, SGLang's and generate-one's routes)
MODEL_HEADER = "X-Model-Id"


@dataclass
class RouterState:
    """The router's settings, its models, its chat-template pool, and its own tasks."""

    config: ServerSettings
    models: ModelManager
    templates: TemplatePool  # where every model's chat template renders
    tasks: list[asyncio.Task] = field(default_factory=list)
    # set when a batching loop dies: the process must exit rather than leave requests hanging
    fatal: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def media(self) -> MediaLimits:
        """What a request's images may be (the image flags)."""
        server = self.config
        return MediaLimits(server.max_images_per_request, not server.disable_image_fetch,
                           server.image_fetch_timeout, server.max_image_bytes,
                           LocalRoots.of(split_paths(server.allowed_local_media_path)),
                           server.media_hosts())

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


async def healthy_model(state: RouterState, name: str | None) -> ServedModel:
    """The model a health check asks about, once its shards have answered.

    `name` (X-Model-Id) names it; None asks about the model a request naming none reaches: the
    default model (while it is stopped, the one model running, if only one runs), or with no
    default model any running one. A model that cannot serve, stopped or restarting, is the
    UnhealthyError of a 503 with Retry-After, so that a load balancer stops sending what would
    get 409s; a name no model has is served_model's 404.
    """
    models = state.models
    try:
        served = models.served_model(name)
    except ModelStateError as err:
        raise UnhealthyError(err.message) from None
    except ModelNotFoundError as err:
        if name is not None:
            raise
        if models.default_id is not None:
            raise UnhealthyError(err.message) from None
        return await _any_healthy(models.served)
    await served.check_health()
    return served


async def _any_healthy(running: dict[str, ServedModel]) -> ServedModel:
    """The first running model whose shards answer; UnhealthyError when none does."""
    failure = UnhealthyError("no model is running: start one with PUT /v1/models/<id>/start")
    for model in list(running.values()):
        try:
            await model.check_health()
        except UnhealthyError as err:
            failure = err
        else:
            return model
    raise failure


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
