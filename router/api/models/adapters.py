"""LoRA adapters over the HTTP API: vLLM's load and unload routes, and /v1/models items.

The routes are vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`; the items are the
adapter items of the `/v1/models` routes (router/api/models/routes.py).

An adapter is listed as vLLM lists one (`root`: where it came from, `parent`: its base model), with
Jan's Model fields beside them; it is loaded and unloaded through the lifecycle's ModelManager.
"""
from __future__ import annotations

import functools
from pathlib import Path

from aiohttp import web

from router.api.models.errors import lora_error_body
from router.errors import AdapterError, ModelNotFoundError, UnknownAdapterError
from router.http.middleware import ERROR_BODY
from router.http.json_body import read_object
from router.lifecycle.adapters import AdapterEntry
from router.lifecycle.manager import ModelManager
from router.state import STATE

_OWNER = "tgi-py"
# the fields a /v1/models/start body names an adapter's files with (the first given wins)
SOURCE_FIELDS = ("lora_path", "source")
PARENT_FIELDS = ("parent", "base_model")


def _manager(request: web.Request) -> ModelManager:
    return request.app[STATE].models


def _source_url(source: str) -> str:
    if source.startswith(("/", "./", "../", "~")):
        try:
            return Path(source).expanduser().resolve().as_uri()
        except (RuntimeError, ValueError, OSError):
            return source
    return f"https://huggingface.co/{source.split('@', 1)[0]}"


def adapter_json(entry: AdapterEntry, parent: str) -> dict:
    """An adapter's item in /v1/models: vLLM's model card with Jan's Model fields.

    The card's fields: id, object, created, owned_by, root, parent. By Jan's fields, an adapter runs
    while it is loaded."""
    return {
        "id": entry.name, "object": "model", "created": entry.created, "owned_by": _OWNER,
        "root": entry.source, "parent": parent,
        "type": "lora", "version": "1", "name": entry.name, "description": "",
        "state": "running", "format": "peft", "source_url": _source_url(entry.source),
        "settings": {}, "parameters": {}, "engine_parameters": {},
        "metadata": {"engine": "hf_inference", "base_model": entry.base_model,
                     "rank": entry.rank, "alpha": entry.alpha, "scaling": entry.scaling,
                     "target_modules": list(entry.target_modules)},
        "assets": [entry.path],
    }


def adapter_items(manager: ModelManager) -> list[dict]:
    """Every running model's adapters, as GET /v1/models lists them."""
    return [adapter_json(entry, model_id) for model_id, served in manager.served.items()
            for entry in served.adapters.entries()]


def find_adapter(manager: ModelManager, name: str) -> dict | None:
    """GET /v1/models/{name}'s item when `name` is an adapter."""
    found = manager.adapter_model(name)
    if found is None:
        return None
    served, _ = found
    entry = served.adapters.get(name)
    return None if entry is None else adapter_json(entry, served.model_name)


def _string_field(body: dict, key: str, *, required: bool) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise AdapterError(f"`{key}` must be a non-empty string")
    return value


async def start_adapter(manager: ModelManager, body: dict) -> web.Response:
    """Cortex's POST /v1/models/start naming an adapter's files.

    Its body: {"model": name, "lora_path" (or "source"), "parent" (or "base_model"): the model to
    load it into, else the default}."""
    for key in body:
        if key not in ("model", *SOURCE_FIELDS, *PARENT_FIELDS):
            raise AdapterError(f"`{key}` is not supported when /v1/models/start loads an "
                               f"adapter; it takes model, {', '.join(SOURCE_FIELDS)} and "
                               f"{', '.join(PARENT_FIELDS)}")
    name = _string_field(body, "model", required=True)
    source = next(_string_field(body, k, required=True) for k in SOURCE_FIELDS if k in body)
    parent = next((_string_field(body, k, required=True) for k in PARENT_FIELDS if k in body),
                  None)
    served, entry = await manager.load_adapter(name, source, model=parent)
    return web.json_response({"id": entry.name, "object": "model", "state": "running",
                              "parent": served.model_name})


async def stop_adapter(manager: ModelManager, name: str) -> dict:
    """Unloads adapter `name` (404 in the route's shape when no model has it)."""
    try:
        await manager.unload_adapter(name)
    except UnknownAdapterError as err:
        raise ModelNotFoundError(err.message) from None
    return {"id": name, "object": "model", "state": "stopped"}


# ---- vLLM's routes -------------------------------------------------------------------------------

async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's POST /v1/load_lora_adapter.

    vLLM's {"lora_name", "lora_path"}; `model` (not vLLM's) picks the base model when several
    run. Answers vLLM's plain-text success line."""
    body = await read_object(request)
    for key in body:
        if key not in ("lora_name", "lora_path", "model"):
            raise AdapterError(f"`{key}` is not supported by /v1/load_lora_adapter; it takes "
                               "lora_name, lora_path and model")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise AdapterError("Both 'lora_name' and 'lora_path' must be provided.")
    model = _string_field(body, "model", required=False)
    await _manager(request).load_adapter(name, path, model=model)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await read_object(request)
    for key in body:
        if key not in ("lora_name", "lora_int_id", "model"):
            raise AdapterError(f"`{key}` is not supported by /v1/unload_lora_adapter; it takes "
                               "lora_name")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise AdapterError("'lora_name' must name the adapter to unload.")
    await stop_adapter(_manager(request), name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _answering_errors_in_openai_shape(handler):
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        request[ERROR_BODY] = lora_error_body  # OpenAI's error object, as vLLM's
        return await handler(request)
    return wrapped


def register(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter",
                        _answering_errors_in_openai_shape(load_lora_adapter))
    app.router.add_post("/v1/unload_lora_adapter",
                        _answering_errors_in_openai_shape(unload_lora_adapter))
