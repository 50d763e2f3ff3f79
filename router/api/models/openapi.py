"""The model routes' part of the OpenAPI document.

Jan's and Cortex's /v1/models family, and vLLM's LoRA adapter routes.
"""
from __future__ import annotations

from router.http.openapi import error_responses, json_content, object_schema, or_sdk_error, ref

_MODEL_STATES = ["not_downloaded", "downloading", "downloaded", "starting", "running", "stopping",
                 "stopped"]


def _model_schemas() -> dict:
    """The schemas of Jan's and Cortex's model objects.

    Jan/Cortex's model objects (router/api/models/routes.py); settings and parameters are checked by
    router/lifecycle/settings.py."""
    string, integer, obj = {"type": "string"}, {"type": "integer"}, {"type": "object"}
    state = {"type": "string", "enum": _MODEL_STATES}
    model = object_schema(["id", "object", "created", "owned_by", "state", "source_url", "settings",
                     "parameters", "metadata"],
                    id=string, object=string, created=integer, owned_by=string, type=string,
                    version=string, name=string, description=string, state=state, format=string,
                    source_url=string, settings=obj, parameters=obj, engine_parameters=obj,
                    metadata={**obj, "properties": {"takes_images": {
                        "type": "boolean", "description": "whether a request to it may hold "
                        "images (its config.json is of a vision-language family)"}}},
                    assets={"type": "array", "items": string})
    return {
        "Model": model,
        "ModelList": object_schema(["object", "data"], object=string,
                             data={"type": "array", "items": ref("ModelOrAdapter")}),
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
        "PullRequest": object_schema(["model"], model={**string, "description": (
            "a short name, a local model directory, a .gguf file, a Hub id, a Hub URL "
            "(https://huggingface.co/<owner>/<repo>[/resolve/<revision>/<file>.gguf]), or "
            "Cortex's <owner>/<repo>:<quantization> (that GGUF of the repository) and "
            "<repo>:<tag> (cortexso/<repo> at branch <tag>)")}, id=string, name=string),
        "ModelPatch": {"type": "object", "description": (
            "Jan's groups, or a Cortex model.yml's flat fields: ctx_len, ngl, n_parallel and "
            "cpu_threads join settings; temperature, top_p, top_k, stream, stop, "
            "frequency_penalty, presence_penalty and max_tokens (token_limit) join parameters; "
            "prompt_template ({system_message}, {prompt}) joins engine_parameters; engine must "
            "name this server or llama.cpp; id, model, created, ... must be unchanged"),
            "properties": dict(
                settings=obj, parameters=obj, engine_parameters=obj, name=string,
                description=string, ctx_len=integer, ngl=integer, n_parallel=integer,
                cpu_threads={**integer, "minimum": 1}, temperature={"type": "number"},
                top_p={"type": "number"}, top_k=integer, stream={"type": "boolean"},
                stop={"oneOf": [string, {"type": "array", "items": string, "maxItems": 4}]},
                frequency_penalty={"type": "number"}, presence_penalty={"type": "number"},
                max_tokens=integer, prompt_template=string,
                engine={**string, "enum": ["tgi-py", "hf_inference", "llama-cpp", "llamacpp",
                                           "cortex.llamacpp", "nitro"]})},
        **_adapter_schemas(model),
    }


def _adapter_schemas(model: dict) -> dict:
    """The schemas of the LoRA adapter routes' bodies and items.

    LoRA adapters: vLLM's load/unload bodies, Cortex's start body naming an adapter's files,
    and an adapter's item in GET /v1/models (vLLM's `root` and `parent` beside Jan's fields)."""
    string = {"type": "string"}
    return {
        "LoadLoraAdapterRequest": object_schema(
            ["lora_name", "lora_path"], lora_name={**string, "description": "the adapter's name: "
                                                   "requests give it as `model`, adapter_id or "
                                                   "lora_path; not a model's id"},
            lora_path={**string, "description": "a local PEFT adapter directory "
                                                "(adapter_config.json, adapter_model.safetensors) "
                                                "or a Hub id, org/name[@revision]"},
            model={**string, "description": "the base model to load it into (not vLLM's); "
                                            "default: the default model"}),
        "UnloadLoraAdapterRequest": object_schema(["lora_name"], lora_name=string),
        "StartRequest": object_schema(
            ["model"], model={**string, "description": "a model's id, or the name to load an "
                                                       "adapter under"},
            lora_path={**string, "description": "an adapter's directory or Hub id: loads a LoRA "
                                                "adapter (`source` is the same)"},
            source=string, parent={**string, "description": "the base model of the adapter "
                                                            "(`base_model` is the same)"},
            base_model=string),
        "AdapterStateResponse": object_schema(["id", "object", "state"], id=string, object=string,
                                              state=string, parent=string),
        "OpenAIError": object_schema(["error"], error=object_schema(
            ["message", "type", "http_status_code"], message=string, type=string,
            http_status_code={"type": "integer"})),
        "ModelOrAdapter": {**model, "properties": {
            **model["properties"],
            "root": {**string, "description": "an adapter's: the path or Hub id it was loaded "
                                              "from"},
            "parent": {**string, "description": "an adapter's: the id of its base model"}}},
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
            "get": {"summary": "One model, or a loaded LoRA adapter", "parameters": model_id,
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
            "summary": "Cortex's start; with lora_path (or source), loads a LoRA adapter under "
                       "`model` into `parent` (or the default model)", **body("StartRequest"),
            "responses": answer("ModelStateResponse", 400, 404, 413, 422, 424, 503,
                                conflict=True)}},
        "/v1/models/stop": {"post": {
            "summary": "Cortex's stop; a LoRA adapter's name unloads it once no request uses it",
            **body("NamedModel"),
            "responses": answer("ModelStateResponse", 400, 404, 413, 422, 503, conflict=True)}},
        "/v1/models/pull": {"post": {
            "summary": "Fetch a model; answers at once, progress in its state and metadata",
            **body("PullRequest"),
            "responses": answer("ModelStateResponse", 400, 403, 413, 422, 429, 503,
                                conflict=True)}},
        **_adapter_paths(),
    }


def _adapter_paths() -> dict:
    def route(summary: str, request: str, errors: tuple[int, ...]) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, **json_content(ref(request))},
            "responses": {"200": {"description": "vLLM's plain-text success line", "content": {
                "text/plain": {"schema": {"type": "string"}}}},
                **error_responses(*errors, shape="OpenAIError")}}}

    return {
        "/v1/load_lora_adapter": route(
            "vLLM's: load a LoRA adapter under a name (400: a bad name, path or adapter, or a "
            "name in use)", "LoadLoraAdapterRequest", (400, 404, 409, 413, 422, 424, 503)),
        "/v1/unload_lora_adapter": route(
            "vLLM's: refuse the adapter to new requests, wait for those using it, unload it",
            "UnloadLoraAdapterRequest", (400, 404, 413, 422, 424)),
    }


def schemas() -> dict:
    return _model_schemas()


def paths() -> dict:
    return or_sdk_error(_model_paths())
