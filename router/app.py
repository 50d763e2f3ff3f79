"""The aiohttp application: routes, error middleware, and start-up (the default model's shards
connected, warmed up and scheduled; the model registry loaded)."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from router.api import invocations, openapi
from router.api.generate_one import routes as generate_one
from router.api.grpc import service as grpc_service
from router.api.models import routes as models
from router.api.openai import chat as openai
from router.api.openai import completions
from router.api.openai.errors import is_openai_sdk, openai_error_body
from router.api.sglang import routes as sglang
from router.api.tgi import routes as tgi
from router.api.tgi.errors import tgi_error_body
from router.api.ui import routes as ui
from router.config import RouterConfig
from router.errors import RouterError
from router.http import access_log
from router.http.middleware import ErrorBodies, api_key_middleware, error_middleware, install_cors
from router.lifecycle.manager import ModelManager
from router.lifecycle.model_host import ModelHostClient
from router.lifecycle.registry import ModelRegistry
from router.lifecycle.served_model import ServedModel, build_served
from router.state import STATE, RouterState

# Every API the router serves: each module turns its wire format into core requests and the core's
# events into its wire format, and registers itself (routes, or a server of its own).
API_MODULES = (tgi, sglang, openai, completions, invocations, generate_one, models, grpc_service,
               openapi, ui)

# errors in TGI's body, a route's own where its API has one, and OpenAI's to an OpenAI SDK on /v1
ERROR_BODIES = ErrorBodies(tgi_error_body, overrides=((is_openai_sdk, openai_error_body),))

log = logging.getLogger("tgi.router")


def router_state(config: RouterConfig, default: ServedModel) -> RouterState:
    """The router's state around its default model, with the registry and model host that
    tgi-launcher gave it (none when the router runs alone)."""
    fatal = asyncio.Event()
    registry = ModelRegistry(Path(config.model_registry_dir) if config.model_registry_dir
                             else None)
    host = ModelHostClient(config.model_host_uds_path) if config.model_host_uds_path else None
    manager = ModelManager(config, registry, host, supervise=lambda coro: _supervise(coro, fatal),
                           default_dtype=config.default_model_dtype,
                           default_device=config.default_model_device)
    manager.add_default(default)
    return RouterState(config, manager, fatal=fatal)


async def build_state(config: RouterConfig) -> RouterState:
    # the launcher restarts a default group that dies while it is warmed up: wait for it
    state = router_state(config, await build_served(config, through_restarts=True))
    await load_startup_adapters(state)
    return state


async def load_startup_adapters(state: RouterState) -> None:
    """--lora-adapters, into the default model, after its warm-up and before serving; one that
    cannot be loaded stops the router with the reason (a ValueError, as a bad flag does)."""
    adapters = state.models.default.adapters
    for name, path in state.config.lora_adapter_dirs():
        try:
            await adapters.load(name, path)
        except RouterError as err:
            await state.models.close()
            raise ValueError(f"--lora-adapters {name}={path}: {err.message}") from None


def create_app(state: RouterState) -> web.Application:
    config = state.config
    app = web.Application(client_max_size=config.payload_limit)
    app.middlewares.append(error_middleware(ERROR_BODIES))
    if config.api_key:
        app.middlewares.append(api_key_middleware(config.api_key, ERROR_BODIES))
    if config.cors_allow_origin:
        install_cors(app, config.cors_allow_origin)
    access_log.install(app)  # outermost: it logs the answers of the middlewares above
    app[STATE] = state
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

    app.on_startup.append(start_models)
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
