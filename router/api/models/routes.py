"""The Jan/Cortex model routes: list, get, pull, start, stop, patch and delete models.

`GET /v1/models` is OpenAI's list too: each item carries OpenAI's four fields and Jan's Model
fields; loaded LoRA adapters are listed beside the models, and start, stop and delete load and
unload them (router/api/models/adapters.py). Ids may contain one '/', raw or percent-encoded
(%2F); aiohttp decodes the path before routing, so both reach the same handler and the id is
checked after decoding.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

from aiohttp import web

from router.api.models import adapters
from router.api.models.errors import models_error_body
from router.errors import ModelStateError, ValidationError
from router.http.middleware import ERROR_BODY
from router.http.json_body import read_object
from router.inputs.images.family import names_image_family
from router.lifecycle.hub_names import hub_name
from router.lifecycle.manager import ModelManager
from router.lifecycle.model_yaml import model_yaml_body
from router.lifecycle.registry import (BUSY, DOWNLOADING, RUNNING, ModelRecord, check_model_id,
                                       parameter_count)
from router.lifecycle.settings import SETTINGS, checked
from router.state import STATE

_OWNER = "tgi-py"


def _manager(request: web.Request) -> ModelManager:
    return request.app[STATE].models


def _parameters_text(count: int) -> str:
    """135M, 1.7B: how Jan's metadata.size names a model's size."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return str(count)


def _size_text(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def _source_url(record: ModelRecord) -> str:
    source = record.source
    try:
        hub = hub_name(source)
    except ValidationError:  # stored before names were read this way
        hub = None
    if hub is not None:
        return hub.url
    if source.startswith(("/", "./", "../", "~")) or source.endswith(".gguf"):
        try:
            return Path(source).expanduser().resolve().as_uri()
        except (RuntimeError, ValueError, OSError):  # "~nobody/x": a path that never resolves
            return source
    return f"https://huggingface.co/{source}" if source else ""


def _metadata(record: ModelRecord) -> dict:
    metadata = {"engine": "hf_inference", "quantization": record.quantization,
                "size": (_parameters_text(record.parameter_count) if record.parameter_count
                         else _size_text(record.size_bytes)),
                "size_bytes": record.size_bytes, "parameter_count": record.parameter_count,
                "takes_images": names_image_family(record.model_dir)}
    if record.state == DOWNLOADING or record.bytes_total:
        metadata["progress"] = {"bytes_done": record.bytes_done,
                                "bytes_total": record.bytes_total}
    if record.error:
        metadata["error"] = record.error
    return metadata


def model_json(record: ModelRecord, served=None) -> dict:
    """Jan's Model object, with OpenAI's fields, and whether it serves embeddings.

    `embedding`: a running model's (`served`) as it serves; a stopped one's as its settings ask
    (a model made to embed serves them whatever they say)."""
    embeds = served.embeds if served is not None else bool(record.settings.get("embedding"))
    return {
        "id": record.id, "object": "model", "created": record.created, "owned_by": _OWNER,
        "type": "model", "version": "1", "name": record.name or record.id.rsplit("/", 1)[-1],
        "description": record.description, "state": record.state, "format": record.format,
        "source_url": _source_url(record), "settings": record.settings,
        "parameters": record.parameters, "engine_parameters": record.engine_parameters,
        "metadata": _metadata(record), "assets": [record.model_dir] if record.model_dir else [],
        "embedding": embeds,
    }


def _get_json(record: ModelRecord, served) -> dict:
    """Jan's GetModelResponse for a model.

    Jan's GetModelResponse: the Model object plus its engine and model parameters, with the
    values in force for a running model."""
    settings = dict(record.settings)
    if served is not None:
        settings.setdefault("ctx_len", served.limits.max_total_tokens)
        if served.config.max_batch_size is not None:
            settings.setdefault("n_parallel", served.config.max_batch_size)
    engine = {**record.engine_parameters, "cont_batching": True}
    for key in ("ngl", "ctx_len", "n_parallel", "cpu_threads"):
        if key in settings:
            engine[key] = settings[key]
    described = model_json(record, served)
    engine["embedding"] = described["embedding"]
    model_parameters = {k: settings[k] for k in ("ctx_len", "ngl", "n_parallel") if k in settings}
    if served is not None and served.shard_info.quantization:  # as the shards serve it
        described["metadata"]["quantization"] = served.shard_info.quantization
    return {**described, "engine_parameters": engine,
            "model_parameters": {**model_parameters, **record.parameters,
                                 "embedding": described["embedding"]}}


def _model_id(request: web.Request) -> str:
    # aiohttp decoded %2F already; a second decoding would let %252F through as a slash
    return check_model_id(request.match_info["model_id"])


def _state_reply(record: ModelRecord) -> web.Response:
    return web.json_response({"id": record.id, "object": "model", "state": record.state})


def _unrecorded(name: str, served) -> ModelRecord:
    """A default model given to the launcher as a path: served, but no registry id."""
    model_dir = served.config.tokenizer_path
    try:
        created = int(Path(model_dir).stat().st_mtime)
    except (OSError, TypeError):
        created = int(time.time())
    return ModelRecord(name, RUNNING, model_dir=model_dir, source=model_dir, created=created,
                       parameter_count=parameter_count(model_dir))


async def list_models(request: web.Request) -> web.Response:
    manager = _manager(request)
    records = dict(manager.registry.records)
    data = [model_json(r, manager.served.get(r.id)) for r in records.values()]
    data += [model_json(_unrecorded(name, served), served)
             for name, served in manager.served.items() if name not in records]
    data += adapters.adapter_items(manager)
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    manager = _manager(request)
    name = request.match_info["model_id"]
    if name in manager.served and name not in manager.registry.records:
        return web.json_response(_get_json(_unrecorded(name, manager.served[name]),
                                           manager.served[name]))
    adapter = adapters.find_adapter(manager, name)
    if adapter is not None:
        return web.json_response(adapter)
    record = manager.registry.get(_model_id(request))
    return web.json_response(_get_json(record, manager.served.get(record.id)))


async def delete_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    if _manager(request).adapter_model(name) is not None:  # an adapter goes when unloaded
        await adapters.stop_adapter(_manager(request), name)
        return web.json_response({"id": name, "object": "model", "deleted": True})
    model_id = _model_id(request)
    await _manager(request).delete(model_id)
    return web.json_response({"id": model_id, "object": "model", "deleted": True})


async def patch_model(request: web.Request) -> web.Response:
    """Jan's grouped fields, or Cortex's model.yml fields (router/lifecycle/model_yaml.py)."""
    model_id = _model_id(request)
    body = await read_object(request)
    manager = _manager(request)
    current = model_json(manager.registry.get(model_id))
    record = manager.patch(model_id, model_yaml_body(body, current))
    return web.json_response(_get_json(record, _manager(request).served.get(record.id)))


async def start_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    if _manager(request).adapter_model(name) is not None:  # loaded: it runs
        return web.json_response({"id": name, "object": "model", "state": "running"})
    return _state_reply(await _manager(request).start(_model_id(request)))


async def stop_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    if _manager(request).adapter_model(name) is not None:
        return web.json_response(await adapters.stop_adapter(_manager(request), name))
    return _state_reply(await _manager(request).stop(_model_id(request)))


async def start_named(request: web.Request) -> web.Response:
    """Cortex's POST /v1/models/start {"model": id, ...}.

    Its other fields are a model.yml's (ctx_len, n_parallel, ngl, cpu_threads, prompt_template,
    ...), kept as a PATCH would keep them."""
    body = await read_object(request)
    manager = _manager(request)
    if any(key in body for key in adapters.SOURCE_FIELDS):  # an adapter's files: load it
        return await adapters.start_adapter(manager, body)
    if manager.adapter_model(body.get("model")) is not None and len(body) == 1:  # it runs
        return web.json_response({"id": body["model"], "object": "model", "state": "running"})
    model_id = check_model_id(body.get("model"))
    fields = {key: value for key, value in body.items() if key != "model"}
    if fields:
        record = manager.registry.get(model_id)
        grouped = model_yaml_body(fields, model_json(record))
        wanted = checked("settings", grouped.get("settings"), SETTINGS)
        if any(record.settings.get(key) != value for key, value in wanted.items()):
            if record.state in BUSY:
                raise ModelStateError(f"model {model_id!r} is {record.state}: stop it before "
                                      "changing its settings", record.state)
        manager.patch(model_id, grouped)
    return _state_reply(await manager.start(model_id))


async def stop_named(request: web.Request) -> web.Response:
    body = await read_object(request)
    for key in body:
        if key != "model":
            raise ValidationError(f"`{key}` is not supported by /v1/models/stop; it takes model")
    if _manager(request).adapter_model(body.get("model")) is not None:
        return web.json_response(await adapters.stop_adapter(_manager(request), body["model"]))
    return _state_reply(await _manager(request).stop(check_model_id(body.get("model"))))


async def pull(request: web.Request) -> web.Response:
    record = _manager(request).pull(await read_object(request))
    return web.json_response({"id": record.id, "object": "model", "state": record.state,
                              "message": f"pulling {record.source} as {record.id}: follow its "
                                         f"state and metadata.progress at GET /v1/models/"
                                         f"{record.id}"})


def _answering_errors_in_models_shape(handler):
    """The model routes answer errors in their body (router.api.models.errors.models_error_body)."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.Response:
        request[ERROR_BODY] = models_error_body
        return await handler(request)
    return wrapped


def register(app: web.Application) -> None:
    routes = [("GET", "/v1/models", list_models), ("POST", "/v1/models/pull", pull),
              ("POST", "/v1/models/start", start_named), ("POST", "/v1/models/stop", stop_named),
              ("PUT", "/v1/models/{model_id:.+}/start", start_model),
              ("PUT", "/v1/models/{model_id:.+}/stop", stop_model),
              ("GET", "/v1/models/{model_id:.+}", get_model),
              ("DELETE", "/v1/models/{model_id:.+}", delete_model),
              ("PATCH", "/v1/models/{model_id:.+}", patch_model)]
    for method, path, handler in routes:
        app.router.add_route(method, path, _answering_errors_in_models_shape(handler))
    adapters.register(app)
