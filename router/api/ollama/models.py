"""Ollama's model routes: tags, show, ps, pull, delete, copy, version.

They read and move the same registry as the /v1/models routes (router/lifecycle/). A model's
`digest` is not an Ollama manifest's (this server keeps none): it is a hash of the model's id,
source and creation time, stable while the model is, as clients only compare digests.
"""
from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timezone
from pathlib import Path

from aiohttp import web

from router import VERSION
from router.api.ollama.errors import OllamaBadRequest, ollama_error_body
from router.api.ollama.generate import NDJSON, _line
from router.api.ollama.keep_alive import KEEP_ALIVE, resolved
from router.errors import ModelNotFoundError, ModelStateError, ValidationError
from router.http.json_body import read_object
from router.inputs.images.family import names_image_family
from router.lifecycle.registry import (DOWNLOADING, NOT_DOWNLOADED, RUNNING, STARTING, STOPPING,
                                       ModelRecord, parameter_count)
from router.state import STATE

PULL_POLL_S = 0.2  # how often a streamed pull looks at its model's progress


def _parameters_text(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count) if count else ""


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(record: ModelRecord) -> str:
    return hashlib.sha256(f"{record.id}\0{record.source}\0{record.created}".encode()).hexdigest()


def _records(request: web.Request) -> dict[str, ModelRecord]:
    """Every model on disk or running, by id: the registry's and an unrecorded default's."""
    models = request.app[STATE].models
    records = {i: r for i, r in models.registry.records.items()
               if r.state not in (NOT_DOWNLOADED, DOWNLOADING)}
    for name, served in models.served.items():
        if name not in records:
            path = served.config.tokenizer_path
            created = int(Path(path).stat().st_mtime) if Path(path).exists() else 0
            records[name] = ModelRecord(name, RUNNING, model_dir=path, source=path,
                                        created=created, parameter_count=parameter_count(path))
    return records


def _details(request: web.Request, record: ModelRecord) -> dict:
    served = request.app[STATE].models.served.get(record.id)
    family = served.shard_info.architecture if served is not None else ""
    return {"parent_model": "", "format": record.format, "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameters_text(record.parameter_count),
            "quantization_level": record.quantization or (
                served.shard_info.quantization if served is not None else "") or ""}


def _entry(request: web.Request, record: ModelRecord) -> dict:
    return {"name": record.id, "model": record.id, "modified_at": _time(record.created),
            "size": record.size_bytes, "digest": _digest(record),
            "details": _details(request, record)}


def _named(request: web.Request, body: dict, key: str = "model") -> ModelRecord:
    name = body.get(key, body.get("name") if key == "model" else None)
    if not isinstance(name, str) or not name:
        raise ValidationError(f"`{key}` must name a model")
    name = resolved(request.app[STATE], name)
    record = _records(request).get(name)
    if record is None:
        raise ModelNotFoundError(f"model '{name}' not found")
    return record


async def tags(request: web.Request) -> web.Response:
    return web.json_response({"models": [_entry(request, r) for r in _records(request).values()]})


async def ps(request: web.Request) -> web.Response:
    keep = request.app[KEEP_ALIVE]
    records = _records(request)
    running = []
    for name in request.app[STATE].models.served:
        entry = _entry(request, records[name])
        expires = keep.expires_at(name)
        # Ollama writes a far-off time for a model kept for ever
        entry["expires_at"] = _time(expires) if expires is not None else "2318-01-01T00:00:00Z"
        entry["size_vram"] = entry["size"]
        running.append(entry)
    return web.json_response({"models": running})


async def show(request: web.Request) -> web.Response:
    record = _named(request, await read_object(request))
    served = request.app[STATE].models.served.get(record.id)
    generates = served is None or served.shard_info.generates
    capabilities = ["completion", "tools"] if generates else []
    if names_image_family(record.model_dir):
        capabilities.append("vision")
    if served.embeds if served is not None else record.settings.get("embedding"):
        capabilities.append("embedding")
    template = served.chat_template.source if served is not None and \
        served.chat_template is not None else ""
    parameters = "\n".join(f"{k} {v}" for k, v in record.parameters.items())
    info = {"general.architecture": _details(request, record)["family"],
            "general.parameter_count": record.parameter_count}
    if served is not None:
        info["context_length"] = served.limits.max_total_tokens
    return web.json_response({
        "modelfile": f"FROM {record.source}\n", "parameters": parameters, "template": template,
        "details": _details(request, record), "model_info": info,
        "capabilities": capabilities, "modified_at": _time(record.created)})


async def delete(request: web.Request) -> web.Response:
    """Deletes a model, stopping it first if it runs (as Ollama unloads a model it removes)."""
    body = await read_object(request)
    models = request.app[STATE].models
    record = _named(request, body)
    if record.id not in models.registry.records:
        raise OllamaBadRequest(f"model {record.id!r} is served from a path, without a registry "
                               "id: there is nothing to delete")
    if record.id in models.served or record.state in (STARTING, STOPPING):
        await models.stop(record.id)  # a stop under way (keep_alive's) is waited for
    await models.delete(record.id)
    return web.Response(status=200)


async def copy(request: web.Request) -> web.Response:
    """Copies a model under another id (stopped; its files hard links to the source's)."""
    body = await read_object(request)
    record = _named(request, body, "source")
    destination = body.get("destination")
    if isinstance(destination, str):  # Ollama's tag: this server's ids carry none
        destination = destination.removesuffix(":latest")
    models = request.app[STATE].models
    if record.id not in models.registry.records:
        raise OllamaBadRequest(f"model {record.id!r} is served from a path, without a registry "
                               "id: pull it to copy it")
    await models.copy(record.id, destination)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def pull(request: web.Request) -> web.StreamResponse:
    """Pulls through the model lifecycle; the progress as Ollama's lines, or one at the end."""
    body = await read_object(request)
    name, stream = body.get("model", body.get("name")), body.get("stream", True)
    if not isinstance(stream, bool):
        raise ValidationError("`stream` must be a boolean")
    for key in body:
        if key not in ("model", "name", "stream", "insecure"):
            raise ValidationError(f"`{key}` is not supported by /api/pull")
    if not isinstance(name, str) or not name:
        raise ValidationError("`model` must name what to pull")
    source = name.removesuffix(":latest")
    models = request.app[STATE].models
    try:
        record = models.pull({"model": source})
    except ModelStateError:  # on disk already, or being pulled: follow it
        record = next((r for r in models.registry.records.values()
                       if source in (r.id, r.source)), None)
        if record is None:
            raise
    if not stream:
        while record.state == DOWNLOADING:
            await asyncio.sleep(PULL_POLL_S)
        if record.error or record.state == NOT_DOWNLOADED:
            raise ModelStateError(f"pulling {name!r} failed: {record.error}", record.state)
        return web.json_response({"status": "success"})
    return await _stream_pull(request, record)


async def _stream_pull(request: web.Request, record: ModelRecord) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": NDJSON})
    await response.prepare(request)
    await response.write(_line({"status": "pulling manifest"}))
    digest = f"sha256:{_digest(record)}"
    last = None
    while True:
        progress = (record.bytes_done, record.bytes_total)
        if record.bytes_total and progress != last:
            await response.write(_line({"status": f"pulling {digest[7:19]}", "digest": digest,
                                        "total": record.bytes_total,
                                        "completed": record.bytes_done}))
            last = progress
        if record.state != DOWNLOADING:
            break
        await asyncio.sleep(PULL_POLL_S)
    if record.error or record.state == NOT_DOWNLOADED:
        error = ModelStateError(f"pulling {record.source!r} failed: {record.error}",
                                record.state)
        await response.write(_line(ollama_error_body(error)))
    else:
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            await response.write(_line({"status": status}))
    await response.write_eof()
    return response


