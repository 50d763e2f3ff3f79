"""Ollama's /api/embed (normalized vectors of one input or several) and the legacy /api/embeddings.

A model not running is started as for /api/chat (keep_alive.model_for), and kept alive as its
`keep_alive` says. /api/embed truncates an input past the model's length unless `truncate` is false
(Ollama's default); the legacy route answers the pooled vector as the model gives it.
"""
from __future__ import annotations

import time

from aiohttp import web

from router.api.ollama.keep_alive import KEEP_ALIVE, model_for, seconds
from router.api.ollama.request import check_fields
from router.core.embedding import embed_inputs
from router.errors import ValidationError
from router.http.json_body import read_object
from router.http.json_out import dumps
from router.inputs.embeddings import finished, read_dimensions, read_inputs
from router.inputs.field_ranges import read_flag
from router.state import STATE

EMBED_FIELDS = {"model", "input", "truncate", "dimensions", "keep_alive", "options"}
EMBEDDINGS_FIELDS = {"model", "prompt", "keep_alive", "options"}
MAX_INPUTS = 2048


async def _model(request: web.Request, body: dict):
    if body.get("options"):  # they say how a runner samples or loads: nothing an embedding takes
        raise ValidationError("`options` are not taken by the embedding routes; the model's "
                              "start settings are PATCH /v1/models/<id>'s")
    served, adapter = await model_for(request, body.get("model"))
    if adapter is not None:
        raise ValidationError("`model` names a LoRA adapter: embeddings come from a base model")
    return served


async def embed(request: web.Request) -> web.Response:
    body = await read_object(request)
    check_fields(body, EMBED_FIELDS, "/api/embed")
    keep = seconds(body.get("keep_alive"))
    started = time.monotonic()
    served = await _model(request, body)
    load_s = request.app[KEEP_ALIVE].loading.pop(served.model_name, 0.0)
    info = served.shard_info
    dimensions = read_dimensions(body.get("dimensions"), "dimensions",
                                 hidden_size=info.hidden_size, matryoshka=info.matryoshka,
                                 allowed=info.matryoshka_dimensions)
    inputs = read_inputs(body.get("input"), "input", max_inputs=MAX_INPUTS)
    result = await served.infer.count_request(embed_inputs(
        served, inputs, field="input", truncate=read_flag(body, "truncate", True)))
    request.app[KEEP_ALIVE].touch(request.app[STATE], served.model_name, keep)
    vectors = finished(result.vectors, normalize=True, dimensions=dimensions)
    out = {"model": body.get("model") or served.model_name, "embeddings": vectors,
           "total_duration": int((time.monotonic() - started) * 1e9),
           "load_duration": int(load_s * 1e9), "prompt_eval_count": result.prompt_tokens}
    text = await dumps(out, numbers=vectors.size)
    return web.Response(text=text, content_type="application/json")


async def embeddings(request: web.Request) -> web.Response:
    body = await read_object(request)
    check_fields(body, EMBEDDINGS_FIELDS, "/api/embeddings")
    keep = seconds(body.get("keep_alive"))
    served = await _model(request, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ValidationError("`prompt` must be a string")
    if not prompt:  # Ollama answers an empty prompt with an empty embedding
        return web.json_response({"embedding": []})
    result = await served.infer.count_request(embed_inputs(served, [prompt], field="prompt",
                                                           truncate=True))
    request.app[KEEP_ALIVE].touch(request.app[STATE], served.model_name, keep)
    return web.json_response({"embedding": result.vectors[0].tolist()})
