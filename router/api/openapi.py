"""The OpenAPI document of what this router serves.

Each API family contributes its part (its package's openapi.py), assembled here with the routes no
single family owns.
"""
from __future__ import annotations

from aiohttp import web

from router import VERSION
from router.api.generate_one import openapi as generate_one
from router.api.models import openapi as models
from router.api.ollama import openapi as ollama
from router.api.openai import openapi as openai
from router.api.sglang import openapi as sglang
from router.api.tgi import openapi as tgi
from router.http.openapi import error_responses, error_schema, json_content, ref

FAMILIES = (tgi, openai, models, sglang, generate_one, ollama)


def openapi_document() -> dict:
    schemas = {"ErrorResponse": error_schema()}
    paths = {}
    for family in FAMILIES:
        schemas.update(family.schemas())
        paths.update(family.paths())
    paths.update({
        "/invocations": {"post": {
            "summary": "SageMaker's route: a body with `inputs` is served as POST /, one with "
                       "`messages` as chat, one with `prompt` as a completion",
            "requestBody": {"required": True, **json_content({"oneOf": [
                ref("CompatGenerateRequest"), ref("ChatRequest"),
                ref("CompletionRequest")]})},
            "responses": {"200": {"description": "OK", "content": {
                **json_content({"anyOf": [{"type": "array", "items": ref("GenerateResponse")},
                                   ref("ChatCompletion"), ref("CompletionFinal")]})["content"],
                "text/event-stream": {"schema": {"anyOf": [
                    ref("StreamResponse"), ref("ChatCompletionChunk"), ref("Chunk")]}}}},
                **error_responses(413, 422, 424, 429, 500, 503)}}},
        "/api-doc/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OK"}}}},
        "/docs": {"get": _page("Swagger UI over this document")},
    })
    paths["/"]["get"] = _page("The chat playground (beside TGI's POST /)")
    return {"openapi": "3.0.3",
            "info": {"title": "tgi-py", "version": VERSION,
                     "description": "Text Generation Inference's API, served by tgi-py"},
            "paths": paths, "components": {"schemas": schemas}}


def _page(summary: str) -> dict:
    """A page for a browser (router/api/ui)."""
    return {"summary": summary, "responses": {"200": {"description": "OK", "content": {
        "text/html": {"schema": {"type": "string"}}}}}}


async def serve_document(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def register(app: web.Application) -> None:
    app.router.add_get("/api-doc/openapi.json", serve_document)
