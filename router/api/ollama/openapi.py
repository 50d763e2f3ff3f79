"""Ollama's part of the OpenAPI document: /api/generate, /api/chat, embeddings and the model routes."""
from __future__ import annotations

from router.http.openapi import json_content, object_schema, ref

_STRING, _INT, _BOOL, _OBJ = ({"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                              {"type": "object"})
_NDJSON = "application/x-ndjson"


def schemas() -> dict:
    strings = {"type": "array", "items": _STRING}
    vector = {"type": "array", "items": {"type": "number"}}
    keep_alive = {"oneOf": [_STRING, {"type": "number"}], "description": (
        "seconds, or a duration (\"5m\"); negative: keep running; 0: stop after this request")}
    format_ = {"oneOf": [{"type": "string", "enum": ["", "json"]}, _OBJ],
               "description": "\"json\" (a JSON object) or a JSON schema the answer follows"}
    options = {"type": "object", "description": (
        "temperature, top_k, top_p, min_p, seed, num_predict, stop, repeat_penalty, "
        "presence_penalty, frequency_penalty, num_ctx; mirostat, tfs_z, typical_p, "
        "repeat_last_n and penalize_newline at their neutral value only")}
    message = object_schema(["role"], role={"type": "string", "enum": [
        "system", "user", "assistant", "tool"]}, content=_STRING, images=strings,
        tool_calls={"type": "array", "items": _OBJ}, tool_name=_STRING)
    done = dict(done=_BOOL, done_reason=_STRING, total_duration=_INT, load_duration=_INT,
                prompt_eval_count=_INT, prompt_eval_duration=_INT, eval_count=_INT,
                eval_duration=_INT, created_at=_STRING, model=_STRING)
    model_entry = object_schema(["name", "model", "modified_at", "size", "digest", "details"],
                                name=_STRING, model=_STRING, modified_at=_STRING, size=_INT,
                                digest=_STRING, details=_OBJ, expires_at=_STRING,
                                size_vram=_INT)
    return {
        "OllamaError": object_schema(["error"], error=_STRING),
        "OllamaGenerateRequest": object_schema(
            ["model"], model=_STRING, prompt=_STRING, system=_STRING, raw=_BOOL, stream=_BOOL,
            context={"type": "array", "items": {"type": "integer", "minimum": 0}},
            images=strings, format=format_, options=options, keep_alive=keep_alive,
            template={**_STRING, "description": "refused: the model's own template renders"},
            suffix={**_STRING, "description": "refused"}, think=_BOOL),
        "OllamaGenerateResponse": object_schema(
            ["model", "created_at", "response", "done"], response=_STRING,
            context={"type": "array", "items": _INT}, **done),
        "OllamaChatRequest": object_schema(
            ["model"], model=_STRING, messages={"type": "array", "items": message},
            tools={"type": "array", "items": _OBJ}, format=format_, options=options,
            stream=_BOOL, keep_alive=keep_alive, think=_BOOL),
        "OllamaChatResponse": object_schema(["model", "created_at", "message", "done"],
                                            message=message, **done),
        "OllamaModelName": object_schema(["model"], model=_STRING),
        "OllamaPullRequest": object_schema(["model"], model=_STRING, stream=_BOOL,
                                           insecure=_BOOL),
        "OllamaCopyRequest": object_schema(["source", "destination"], source=_STRING,
                                           destination=_STRING),
        "OllamaModels": object_schema(["models"], models={"type": "array",
                                                          "items": model_entry}),
        "OllamaStatus": object_schema([], status=_STRING, digest=_STRING, total=_INT,
                                      completed=_INT),
        "OllamaEmbedRequest": object_schema(
            ["model", "input"], model=_STRING, input={"oneOf": [_STRING, strings]},
            truncate=_BOOL, dimensions=_INT, keep_alive=keep_alive,
            options={**_OBJ, "description": "refused unless empty"}),
        "OllamaEmbedResponse": object_schema(
            ["model", "embeddings"], model=_STRING, embeddings={"type": "array", "items": vector},
            total_duration=_INT, load_duration=_INT, prompt_eval_count=_INT),
        "OllamaEmbeddingsRequest": object_schema(["model", "prompt"], model=_STRING,
                                                 prompt=_STRING, keep_alive=keep_alive,
                                                 options={**_OBJ, "description":
                                                          "refused unless empty"}),
        "OllamaEmbeddingsResponse": object_schema(["embedding"], embedding=vector),
    }


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "Error", **json_content(ref("OllamaError"))}
            for s in statuses}


def _operation(summary: str, request: str | None, response: dict | None, *statuses: int,
               stream: str | None = None) -> dict:
    content = {}
    if response is not None:
        content.update(json_content(response)["content"])
    if stream is not None:
        content[_NDJSON] = {"schema": ref(stream)}
    ok = {"description": "OK", "content": content} if content else {"description": "OK"}
    operation = {"summary": summary, "responses": {"200": ok, **_errors(*statuses)}}
    if request is not None:
        operation["requestBody"] = {"required": True, **json_content(ref(request))}
    return operation


def paths() -> dict:
    generation = (400, 404, 409, 413, 424, 429, 500, 503)
    return {
        "/api/generate": {"post": _operation(
            "Ollama's generate: NDJSON lines unless `stream: false`", "OllamaGenerateRequest",
            ref("OllamaGenerateResponse"), *generation, stream="OllamaGenerateResponse")},
        "/api/chat": {"post": _operation(
            "Ollama's chat: NDJSON lines unless `stream: false`", "OllamaChatRequest",
            ref("OllamaChatResponse"), *generation, stream="OllamaChatResponse")},
        "/api/tags": {"get": _operation("The models on disk or running", None,
                                        ref("OllamaModels"))},
        "/api/ps": {"get": _operation("The running models", None, ref("OllamaModels"))},
        "/api/show": {"post": _operation("A model's details and template", "OllamaModelName",
                                         _OBJ, 400, 404, 413)},
        "/api/pull": {"post": _operation(
            "Pulls a model (as POST /v1/models/pull); Ollama's progress lines",
            "OllamaPullRequest", ref("OllamaStatus"), 400, 403, 404, 409, 413, 429, 503,
            stream="OllamaStatus")},
        "/api/delete": {"delete": _operation("Deletes a model, stopping it first",
                                             "OllamaModelName", None, 400, 404, 409, 413)},
        "/api/copy": {"post": _operation("Copies a model under another id, stopped",
                                         "OllamaCopyRequest", None, 400, 404, 409, 413)},
        "/api/version": {"get": _operation("The server's version", None,
                                           object_schema(["version"], version=_STRING))},
        "/api/embed": {"post": _operation(
            "Normalized embeddings of one input or several (400: a model that does not embed)",
            "OllamaEmbedRequest", ref("OllamaEmbedResponse"), 400, 404, 409, 413, 424, 503)},
        "/api/embeddings": {"post": _operation(
            "The legacy embedding of one prompt, as the model pools it",
            "OllamaEmbeddingsRequest", ref("OllamaEmbeddingsResponse"), 400, 404, 409, 413,
            424, 503)},
    }
