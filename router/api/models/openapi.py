"""The model routes' part of the OpenAPI document (Jan's and Cortex's /v1/models family)."""
from __future__ import annotations

from router.http.openapi import error_responses, json_content, object_schema, ref

_MODEL_STATES = ["not_downloaded", "downloading", "downloaded", "starting", "running", "stopping",
                 "stopped"]


def _model_schemas() -> dict:
    """Jan/Cortex's model objects (router/api/models/routes.py); settings and parameters are checked by
    router/lifecycle/settings.py."""
    string, integer, obj = {"type": "string"}, {"type": "integer"}, {"type": "object"}
    state = {"type": "string", "enum": _MODEL_STATES}
    model = object_schema(["id", "object", "created", "owned_by", "state", "source_url", "settings",
                     "parameters", "metadata"],
                    id=string, object=string, created=integer, owned_by=string, type=string,
                    version=string, name=string, description=string, state=state, format=string,
                    source_url=string, settings=obj, parameters=obj, engine_parameters=obj,
                    metadata=obj, assets={"type": "array", "items": string})
    return {
        "Model": model,
        "ModelList": object_schema(["object", "data"], object=string,
                             data={"type": "array", "items": ref("Model")}),
        "GetModelResponse": {**model, "required": [*model["required"], "engine_parameters",
                                                   "model_parameters"],
                             "properties": {**model["properties"], "model_parameters": obj}},
        "ModelStateResponse": object_schema(["id", "object", "state"], id=string, object=string,
                                      state=state),
        "DeleteModelResponse": object_schema(["id", "object", "deleted"], id=string, object=string,
                                       deleted={"type": "boolean"}),
        "ModelStateError": object_schema(["error", "error_type", "state"], error=string,
                                   error_type=string, state=state),
        "NamedModel": object_schema(["model"], model=string),
        "PullRequest": object_schema(["model"], model={**string, "description": "a short name, a "
                                                 "local model directory, a .gguf file or a Hub id"},
                               id=string, name=string),
        "ModelPatch": {"type": "object", "properties": dict(
            settings=obj, parameters=obj, engine_parameters=obj, name=string,
            description=string)},
    }


def _model_paths() -> dict:
    def answer(schema: str, *errors: int, conflict: bool = False) -> dict:
        responses = {"200": {"description": "OK", **json_content(ref(schema))}, **error_responses(*errors)}
        if conflict:
            responses["409"] = {"description": "Not possible in the model's state",
                                **json_content(ref("ModelStateError"))}
        return responses

    def body(schema: str) -> dict:
        return {"requestBody": {"required": True, **json_content(ref(schema))}}

    model_id = [{"name": "model_id", "in": "path", "required": True,
                 "schema": {"type": "string"}, "description": "a name or owner/name"}]
    return {
        "/v1/models": {"get": {"summary": "The models this server knows (OpenAI's list, with "
                                          "Jan's fields)", "responses": answer("ModelList")}},
        "/v1/models/{model_id}": {
            "get": {"summary": "One model", "parameters": model_id,
                    "responses": answer("GetModelResponse", 400, 404)},
            "delete": {"summary": "Forget a model (and delete the files it pulled)",
                       "parameters": model_id,
                       "responses": answer("DeleteModelResponse", 400, 404, conflict=True)},
            "patch": {"summary": "Change a model's settings, parameters or prompt pieces",
                      "parameters": model_id, **body("ModelPatch"),
                      "responses": answer("GetModelResponse", 400, 404, 413, 422)}},
        "/v1/models/{model_id}/start": {"put": {
            "summary": "Start a model (its own shard group); idempotent", "parameters": model_id,
            "responses": answer("ModelStateResponse", 400, 404, 422, 424, 503, conflict=True)}},
        "/v1/models/{model_id}/stop": {"put": {
            "summary": "Stop a model after its requests in flight; idempotent",
            "parameters": model_id,
            "responses": answer("ModelStateResponse", 400, 404, 503, conflict=True)}},
        "/v1/models/start": {"post": {
            "summary": "Cortex's start", **body("NamedModel"),
            "responses": answer("ModelStateResponse", 400, 404, 413, 422, 424, 503,
                                conflict=True)}},
        "/v1/models/stop": {"post": {
            "summary": "Cortex's stop", **body("NamedModel"),
            "responses": answer("ModelStateResponse", 400, 404, 413, 422, 503, conflict=True)}},
        "/v1/models/pull": {"post": {
            "summary": "Fetch a model; answers at once, progress in its state and metadata",
            **body("PullRequest"),
            "responses": answer("ModelStateResponse", 400, 413, 422, 503, conflict=True)}},
    }


def schemas() -> dict:
    return _model_schemas()


def paths() -> dict:
    return _model_paths()
