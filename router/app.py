"""The aiohttp application: routes, middlewares, start-up and shutdown.

At start-up the default model's shards are connected, warmed up and scheduled, and the model
registry loaded.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from router.api import invocations, openapi
from router.api.generate_one import routes as generate_one
from router.api.grpc import server as grpc_server
from router.api.models import routes as models
from router.api.ollama import routes as ollama
from router.api.openai import chat as openai
from router.api.openai import completions
from router.api.openai import embeddings as openai_embeddings
from router.api.openai.errors import is_openai_sdk, openai_error_body
from router.api.sglang import routes as sglang
from router.api.tgi import embed as tei_embed
from router.api.tgi import routes as tgi
from router.api.tgi.errors import tgi_error_body
from router.api.ui import routes as ui
from router.config import RouterConfig
from router.config.model import ModelSettings
from router.config.server import ServerSettings
from router.errors import RouterError
from router.http import access_log
from router.http.middleware import ErrorBodies, api_key_middleware, error_middleware, install_cors
from router.http.sse import WRITE_TIMEOUT
from router.inputs.template_pool import RenderLimits, TemplatePool
from router.lifecycle.drain import drain_for_shutdown
from router.lifecycle.local_paths import LocalRoots, split_paths
from router.lifecycle.manager import ModelManager
from router.lifecycle.model_host import ModelHostClient
from router.lifecycle.registry import ModelRegistry
from router.lifecycle.served_model import build_served
from router.state import MODEL_HEADER, STATE, RouterState

# Every API the router serves: each module turns its wire format into core requests and the core's
# events into its wire format, and registers itself (routes, or a server of its own).
API_MODULES = (tgi, tei_embed, sglang, openai, completions, openai_embeddings, invocations,
               generate_one, models, ollama, grpc_server, openapi, ui)

# errors in TGI's body, a route's own where its API has one, and OpenAI's to an OpenAI SDK on /v1
ERROR_BODIES = ErrorBodies(tgi_error_body, overrides=((is_openai_sdk, openai_error_body),))

log = logging.getLogger("tgi.router")


def router_state(server: ServerSettings, model_defaults: ModelSettings) -> RouterState:
    """The router's state before its default model runs (state.models.add_default adds it).

    Its registry and model host are what tgi-launcher gave it (none when the router runs alone);
    `model_defaults`: the settings every model starts from, the default model's.
    """
    fatal = asyncio.Event()
    registry = ModelRegistry(Path(server.model_registry_dir) if server.model_registry_dir
                             else None)
    host = ModelHostClient(server.model_host_uds_path) if server.model_host_uds_path else None
    manager = ModelManager(model_defaults, registry, host,
                           supervise=lambda coro: _supervise(coro, fatal),
                           default_dtype=server.default_model_dtype,
                           default_device=server.default_model_device,
                           local_roots=LocalRoots.of(split_paths(server.allowed_local_model_path)))
    # the processes chat templates render in: as many as the default model's validation workers
    templates = TemplatePool(RenderLimits.for_payload(server.payload_limit),
                             size=model_defaults.validation_workers)
    return RouterState(server, manager, templates, fatal=fatal)


async def build_state(config: RouterConfig) -> RouterState:
    """The router's state with its default model warmed up and its LoRA adapters loaded."""
    state = router_state(config.server, config.model)
    # the launcher restarts a default group that dies while it is warmed up: wait for it
    state.models.add_default(await build_served(config.model, through_restarts=True,
                                                adapter_links=state.models.adapter_links))
    await load_startup_adapters(state)
    return state


async def load_startup_adapters(state: RouterState) -> None:
    """--lora-adapters, loaded into the default model after its warm-up and before serving.

    One that cannot be loaded stops the router with the reason (a ValueError, as a bad flag
    does).
    """
    adapters = state.models.default.adapters
    for name, path in state.config.lora_adapter_dirs():
        try:
            await adapters.load(name, path, operator=True)
        except RouterError as err:
            await state.models.close()
            raise ValueError(f"--lora-adapters {name}={path}: {err.message}") from None


def create_app(state: RouterState) -> web.Application:
    """The application serving `state`: every API's routes, and its models' start and stop."""
    config = state.config
    app = web.Application(client_max_size=config.payload_limit)
    app.middlewares.append(error_middleware(ERROR_BODIES))
    if config.api_key:
        app.middlewares.append(api_key_middleware(config.api_key, ERROR_BODIES,
                                                  private_headers=(MODEL_HEADER,)))
    if config.cors_allow_origin:
        install_cors(app, config.cors_allow_origin)
    access_log.install(app)  # outermost: it logs the answers of the middlewares above
    app[STATE] = state
    app[WRITE_TIMEOUT] = config.stream_write_timeout
    for api in API_MODULES:
        api.register(app)

    async def start_models(app):
        for served in state.models.served.values():
            served.start(state.models.supervise)
        if config.autostart == "true":
            state.tasks.append(asyncio.create_task(state.models.autostart()))
        if state.models.host is not None:
            state.tasks.append(asyncio.create_task(state.models.settle_lost_groups()))

    async def stop_models(app):
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        await state.models.close()
        await state.templates.close()

    async def drain_models(app):
        # after the gRPC server's drain (registered with its API above): both stop taking calls
        # first, then the requests in flight get until the deadline
        await drain_for_shutdown(list(state.models.served.values()), config.drain_timeout)

    app.on_startup.append(start_models)
    app.on_shutdown.append(drain_models)
    app.on_cleanup.append(stop_models)
    return app


async def _supervise(coro, fatal: asyncio.Event) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        # the loop must never die silently: without it every request would hang
        log.exception("a batching loop crashed; stopping the router")
        fatal.set()
