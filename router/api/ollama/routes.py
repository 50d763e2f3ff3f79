"""Registers Ollama's routes, and the task that stops models idle past their keep_alive."""
from __future__ import annotations

import asyncio

from aiohttp import web

from router.api.ollama import embed, generate, models
from router.api.ollama.errors import ollama_route
from router.api.ollama.keep_alive import KEEP_ALIVE, KeepAlive, stop_idle
from router.state import STATE

_REAPER = web.AppKey("ollama_keep_alive_task", asyncio.Task)


def register(app: web.Application) -> None:
    app[KEEP_ALIVE] = KeepAlive()
    routes = [("POST", "/api/generate", generate.generate), ("POST", "/api/chat", generate.chat),
              ("GET", "/api/tags", models.tags), ("POST", "/api/show", models.show),
              ("GET", "/api/ps", models.ps), ("POST", "/api/pull", models.pull),
              ("DELETE", "/api/delete", models.delete), ("POST", "/api/copy", models.copy),
              ("GET", "/api/version", models.version), ("POST", "/api/embed", embed.embed),
              ("POST", "/api/embeddings", embed.embeddings)]
    for method, path, handler in routes:
        app.router.add_route(method, path, ollama_route(handler))

    async def start(app: web.Application) -> None:
        app[_REAPER] = asyncio.create_task(stop_idle(app[STATE], app[KEEP_ALIVE]))

    async def stop(app: web.Application) -> None:
        task = app.get(_REAPER)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app.on_startup.append(start)
    app.on_shutdown.insert(0, stop)
