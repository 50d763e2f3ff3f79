"""The OpenAPI document of what this router serves, built from the same names the code uses."""
from __future__ import annotations

from router import VERSION
from router.inputs.validation import INTEGER_WIRE_TYPES, PARAMETER_TYPES
from router.inputs.field_ranges import FLOAT32_MAX, INT32, UINT32, UINT64, IntType



def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(kind: str, **extra) -> dict:
    return {"type": kind, "nullable": True, **extra}


# documented bounds (TGI's rules, checked in router.inputs.validation); the integers' ranges and formats
# come from the wire types they travel in
_PARAMETER_LIMITS = {
    "best_of": {"minimum": 0, "exclusiveMinimum": True},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "max_new_tokens": {"minimum": 0, "exclusiveMinimum": True, "default": 100},
    "repetition_penalty": {"minimum": 0, "exclusiveMinimum": True},
    "temperature": {"minimum": 0, "exclusiveMinimum": True},
    "top_k": {"minimum": 0, "exclusiveMinimum": True},
    "top_n_tokens": {"minimum": 0},
    "truncate": {"minimum": 0, "exclusiveMinimum": True},
    "top_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "typical_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "stop": {"items": {"type": "string"}, "maxItems": 4},
}


def int_schema(wire: IntType, **bounds) -> dict:
    """An integer schema: its wire type's format and range, narrowed by the documented bounds."""
    schema = {"type": "integer", "format": wire.openapi_format, **bounds}
    schema["minimum"] = max(bounds.get("minimum", wire.low), wire.low)
    schema["maximum"] = min(bounds.get("maximum", wire.high), wire.high)
    return schema


def float_schema(**bounds) -> dict:
    """A float32 number: finite, within float32's range unless the bounds say less."""
    return {"type": "number", "format": "float", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX,
            **bounds}


def _parameters_schema() -> dict:
    properties = {}
    for name, kind in sorted(PARAMETER_TYPES.items()):
        limits = _PARAMETER_LIMITS.get(name, {})
        if kind == "integer":
            properties[name] = {**int_schema(INTEGER_WIRE_TYPES[name], **limits), "nullable": True}
        elif kind == "number":
            properties[name] = {**float_schema(**limits), "nullable": True}
        else:
            properties[name] = _nullable(kind, **limits)
    return {"type": "object", "properties": properties}


def _token(with_special: bool) -> dict:
    props = {"id": {"type": "integer"}, "text": {"type": "string"},
             "logprob": _nullable("number")}
    if with_special:
        props["special"] = {"type": "boolean"}
    return {"type": "object", "required": list(props), "properties": props}


_FINISH = {"type": "string", "enum": ["length", "eos_token", "stop_sequence"]}


def _details(best_of: bool) -> dict:
    props = {
        "finish_reason": _FINISH, "generated_tokens": {"type": "integer"},
        "seed": _nullable("integer"),
        "prefill": {"type": "array", "items": _ref("PrefillToken")},
        "tokens": {"type": "array", "items": _ref("Token")},
        "top_tokens": {"type": "array", "items": {"type": "array", "items": _ref("Token")}},
    }
    if best_of:
        props["best_of_sequences"] = {"type": "array", "items": _ref("BestOfSequence")}
    return {"type": "object", "required": ["finish_reason", "generated_tokens", "prefill", "tokens"],
            "properties": props}


def _error() -> dict:
    return {"type": "object", "required": ["error", "error_type"],
            "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


# OpenAI's and SGLang's logit_bias
LOGIT_BIAS = {"type": "object", "nullable": True,
              "description": "token id (a decimal string) -> a bias in [-100, 100] added to its "
                             "logit before any other processing",
              "additionalProperties": float_schema(minimum=-100, maximum=100)}


def _errors(*statuses: int, shape: str = "ErrorResponse") -> dict:
    return {str(s): {"description": "Error", **_json(_ref(shape))} for s in statuses}


def _post(summary: str, request: str, response: dict, *, stream: bool = False,
          stream_on_request: bool = False) -> dict:
    """A generation route: JSON, SSE (`stream`), or either as the body's `stream` field asks."""
    sse = {"text/event-stream": {"schema": _ref("StreamResponse")}}
    content = sse if stream else _json(response)["content"]
    if stream_on_request:
        content = {**content, **sse}
    return {"post": {"summary": summary, "requestBody": {"required": True, **_json(_ref(request))},
                     "responses": {"200": {"description": "OK", "content": content},
                                   **_errors(413, 422, 424, 429, 500, 503)}}}


def _object(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


def _openai_sampling() -> dict:
    """The sampling fields both OpenAI routes share, with the bounds router.api.openai.request checks."""
    return dict(
        max_tokens={**int_schema(INT32, minimum=1), "nullable": True},
        max_completion_tokens={**int_schema(INT32, minimum=1), "nullable": True},
        temperature={**float_schema(minimum=0, maximum=2), "nullable": True},
        top_p={**float_schema(minimum=0, maximum=1, exclusiveMinimum=True), "nullable": True},
        top_k={**int_schema(INT32, minimum=-1), "nullable": True,
               "description": "vLLM's extension: -1 or 0 is off"},
        ignore_eos={"type": "boolean", "nullable": True,
                    "description": "vLLM's extension: run to max_tokens past the end of sequence"},
        min_tokens={**int_schema(INT32, minimum=0), "nullable": True,
                    "description": "vLLM's extension: no end of sequence before this many tokens"},
        n={**int_schema(INT32, minimum=1), "nullable": True},
        seed={**int_schema(UINT64), "nullable": True},
        frequency_penalty={**float_schema(minimum=-2, maximum=2), "nullable": True},
        presence_penalty={**float_schema(minimum=-2, maximum=2), "nullable": True},
        repetition_penalty={**float_schema(minimum=0, exclusiveMinimum=True), "nullable": True,
                            "description": "vLLM's extension: TGI's multiplicative penalty, "
                                           "1 is off"},
        logit_bias=LOGIT_BIAS,
        stop={"nullable": True, "oneOf": [{"type": "string"},
                                          {"type": "array", "items": {"type": "string"}}]},
        stream={"type": "boolean", "nullable": True},
        stream_options={"type": "object", "nullable": True,
                        "properties": {"include_usage": {"type": "boolean", "nullable": True}}})


def _openai_schemas() -> dict:
    string, integer = {"type": "string"}, {"type": "integer"}
    envelope = dict(id=string, object=string, created=integer, model=string,
                    system_fingerprint=string)
    usage = _ref("Usage")
    return {
        "Usage": _object(["prompt_tokens", "completion_tokens", "total_tokens"],
                         prompt_tokens=integer, completion_tokens=integer, total_tokens=integer),
        "ChatRequest": _object(["messages"], model=string, messages={"type": "array", "items": {
            "type": "object", "required": ["role"]}}, **_openai_sampling(),
            logprobs=_nullable("boolean"), top_logprobs={**int_schema(INT32, minimum=0),
                                                         "nullable": True},
            tools=_nullable("array"), tool_choice={}, response_format=_nullable("object")),
        "ChatCompletion": _object(["id", "created", "model", "system_fingerprint", "choices",
                                   "usage"], **envelope, usage=usage,
                                  choices={"type": "array", "items": _object(
                                      ["index", "message", "finish_reason"], index=integer,
                                      message={"type": "object"}, finish_reason=string,
                                      logprobs=_nullable("object"))}),
        "CompletionRequest": _object(["prompt"], model=string, prompt={}, suffix=_nullable("string"),
                                     echo=_nullable("boolean"), **_openai_sampling(),
                                     logprobs={**int_schema(INT32, minimum=0), "nullable": True},
                                     best_of={**int_schema(INT32, minimum=1), "nullable": True,
                                              "description": "candidates per prompt (at most "
                                                             "--max-best-of, at least n; not "
                                                             "with stream)"},
                                     response_format=_nullable("object")),
        "CompletionFinal": _object(["id", "created", "model", "system_fingerprint", "choices",
                                    "usage"], **envelope, usage=usage,
                                   choices={"type": "array", "items": _object(
                                       ["index", "text", "finish_reason"], index=integer,
                                       text=string, finish_reason=string,
                                       logprobs=_nullable("object"))}),
    }


_MODEL_STATES = ["not_downloaded", "downloading", "downloaded", "starting", "running", "stopping",
                 "stopped"]


def _model_schemas() -> dict:
    """Jan/Cortex's model objects (router/api/models/routes.py); settings and parameters are checked by
    router/lifecycle/settings.py."""
    string, integer, obj = {"type": "string"}, {"type": "integer"}, {"type": "object"}
    state = {"type": "string", "enum": _MODEL_STATES}
    model = _object(["id", "object", "created", "owned_by", "state", "source_url", "settings",
                     "parameters", "metadata"],
                    id=string, object=string, created=integer, owned_by=string, type=string,
                    version=string, name=string, description=string, state=state, format=string,
                    source_url=string, settings=obj, parameters=obj, engine_parameters=obj,
                    metadata=obj, assets={"type": "array", "items": string})
    return {
        "Model": model,
        "ModelList": _object(["object", "data"], object=string,
                             data={"type": "array", "items": _ref("Model")}),
        "GetModelResponse": {**model, "required": [*model["required"], "engine_parameters",
                                                   "model_parameters"],
                             "properties": {**model["properties"], "model_parameters": obj}},
        "ModelStateResponse": _object(["id", "object", "state"], id=string, object=string,
                                      state=state),
        "DeleteModelResponse": _object(["id", "object", "deleted"], id=string, object=string,
                                       deleted={"type": "boolean"}),
        "ModelStateError": _object(["error", "error_type", "state"], error=string,
                                   error_type=string, state=state),
        "NamedModel": _object(["model"], model=string),
        "PullRequest": _object(["model"], model={**string, "description": "a local model "
                                                 "directory, a .gguf file or a Hub id"},
                               id=string, name=string),
        "ModelPatch": {"type": "object", "properties": dict(
            settings=obj, parameters=obj, engine_parameters=obj, name=string,
            description=string)},
    }


def _model_paths() -> dict:
    def answer(schema: str, *errors: int, conflict: bool = False) -> dict:
        responses = {"200": {"description": "OK", **_json(_ref(schema))}, **_errors(*errors)}
        if conflict:
            responses["409"] = {"description": "Not possible in the model's state",
                                **_json(_ref("ModelStateError"))}
        return responses

    def body(schema: str) -> dict:
        return {"requestBody": {"required": True, **_json(_ref(schema))}}

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


def _sglang_schemas() -> dict:
    """SGLang's native /generate (router.api.sglang.request checks these bounds)."""
    string, boolean = {"type": "string"}, {"type": "boolean"}
    token_id = int_schema(UINT32)
    strings = {"oneOf": [string, {"type": "array", "items": string}]}
    sampling = _object(
        [], max_new_tokens={**int_schema(UINT32, minimum=1), "default": 128},
        min_new_tokens=int_schema(UINT32), n={**int_schema(UINT32, minimum=1), "default": 1},
        temperature={**float_schema(minimum=0), "default": 1.0},
        top_p=float_schema(minimum=0, maximum=1, exclusiveMinimum=True),
        top_k={**int_schema(INT32, minimum=-1), "default": -1,
               "description": "-1 (off) or at least 1"},
        min_p=float_schema(minimum=0, maximum=1),
        frequency_penalty=float_schema(minimum=-2, maximum=2),
        presence_penalty=float_schema(minimum=-2, maximum=2),
        repetition_penalty=float_schema(minimum=0, maximum=2, exclusiveMinimum=True),
        logit_bias=LOGIT_BIAS,
        sampling_seed=int_schema(UINT64), stop=strings,
        stop_token_ids={"type": "array", "items": token_id}, ignore_eos=boolean,
        skip_special_tokens=boolean, no_stop_trim=boolean,
        spaces_between_special_tokens={**boolean, "description": "accepted either way: the "
                                       "fast tokenizer's decoder gives the same text (as SGLang)"},
        json_schema={**string, "description": "a JSON schema, as a JSON string"},
        regex=string, ebnf={**string, "description": "GBNF (`root ::= ...`) or Lark"})
    sampling["additionalProperties"] = False
    for schema in sampling["properties"].values():
        schema["nullable"] = True
    per_prompt = lambda schema: {"oneOf": [schema, {"type": "array", "items": schema}]}  # noqa: E731
    vector = {"type": "array", "minItems": 1, "items": {"type": "number"},
              "description": "one row per prompt position, as wide as the model's hidden size "
                             "(`hidden_size` in /get_model_info)"}
    vectors = {"type": "array", "minItems": 1, "items": vector}
    request = _object(
        [], text=strings,
        input_ids={"oneOf": [{"type": "array", "items": token_id, "minItems": 1},
                             {"type": "array", "minItems": 1, "items": {
                                 "type": "array", "items": token_id, "minItems": 1}}]},
        sampling_params={"oneOf": [_ref("SglangSamplingParams"),
                                   {"type": "array", "items": _ref("SglangSamplingParams")}]},
        rid=strings, stream=boolean, return_logprob=per_prompt(boolean),
        logprob_start_len=per_prompt({**int_schema(INT32, minimum=-1), "default": -1}),
        top_logprobs_num=per_prompt(int_schema(UINT32)), return_text_in_logprobs=boolean,
        input_embeds={"oneOf": [vectors, {"type": "array", "minItems": 1, "items": vectors}],
                      "description": "the prompt as vectors fed in place of the embedding "
                                     "lookup; never served from the prefix cache"},
        token_ids_logprob={"oneOf": [{"type": "array", "items": token_id, "maxItems": 1024},
                                     {"type": "array", "items": {
                                         "type": "array", "items": token_id,
                                         "maxItems": 1024}}],
                           "description": "with return_logprob: token ids whose log-"
                                          "probabilities come back at every position"},
        return_hidden_states={**per_prompt(boolean), "description": (
            "meta_info.hidden_states: the prompt's final hidden states (one row per position) "
            "as the first entry, then one vector per later token")})
    request["anyOf"] = [{"required": ["text"]}, {"required": ["input_ids"]},
                        {"required": ["input_embeds"]}]
    logprob = {"type": "array", "items": {}, "minItems": 3, "maxItems": 3,
               "description": "[logprob or null, token id, text or null]"}
    meta = _object(["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                    "e2e_latency"], id=string, finish_reason={
                        "type": "object", "nullable": True, "required": ["type"],
                        "properties": {"type": {"type": "string",
                                                "enum": ["stop", "length", "abort"]},
                                       "matched": {}, "length": {"type": "integer"},
                                       "message": string}},
                   prompt_tokens={"type": "integer"}, completion_tokens={"type": "integer"},
                   cached_tokens={"type": "integer"}, e2e_latency={"type": "number"},
                   input_token_logprobs={"type": "array", "items": logprob},
                   output_token_logprobs={"type": "array", "items": logprob},
                   input_top_logprobs={"type": "array", "items": {
                       "type": "array", "nullable": True, "items": logprob}},
                   output_top_logprobs={"type": "array", "items": {
                       "type": "array", "items": logprob}},
                   input_token_ids_logprobs={"type": "array", "items": {
                       "type": "array", "nullable": True, "items": logprob}},
                   output_token_ids_logprobs={"type": "array", "items": {
                       "type": "array", "items": logprob}},
                   hidden_states={"type": "array", "items": {"type": "array"}})
    return {
        "SglangSamplingParams": sampling, "SglangGenerateRequest": request,
        "SglangMetaInfo": meta,
        "SglangGenerateResponse": _object(["text", "meta_info"], text=string,
                                          meta_info=_ref("SglangMetaInfo"),
                                          index={"type": "integer"}),
        "SglangErrorResponse": _object(["error"], error=_object(
            ["message"], message=string, type=string, code={"type": "integer"})),
        "AbortRequest": _object([], rid=string, abort_all=boolean),
    }


def _sglang_paths() -> dict:
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    ok_json = lambda ref: {"200": {"description": "OK", **_json(_ref(ref))}}  # noqa: E731
    return {
        "/abort_request": {"post": {
            "summary": "SGLang: cancel the running request named `rid` (or all, `abort_all`)",
            "requestBody": {"required": True, **_json(_ref("AbortRequest"))},
            "responses": {"200": {"description": "Aborted, or no such request running"},
                          **_errors(413, 422, shape="SglangErrorResponse")}}},
        "/flush_cache": {"post": {
            "summary": "SGLang: drop the prefix cache (400 while requests are in flight)",
            "responses": {"200": {"description": "Flushed", **text},
                          "400": {"description": "Requests are in flight", **text}}}},
        "/health_generate": {"get": {
            "summary": "SGLang: health, generating one token", "responses": {
                "200": {"description": "A token was generated"}, **_errors(503)}}},
        "/get_model_info": {"get": {"summary": "SGLang: the model served", "responses": {
            "200": {"description": "OK", **_json(_object(
                ["model_path", "is_generation"], model_path={"type": "string"},
                tokenizer_path={"type": "string"}, is_generation={"type": "boolean"},
                hidden_size={"type": "integer"}))}}}},
        "/get_server_info": {"get": {"summary": "SGLang: server settings and limits",
                                     "responses": ok_json("Info")}},
    }


def _generate_one_schemas() -> dict:
    """/api/generate-one|batch (router.api.generate_one.request checks these bounds)."""
    string, boolean = {"type": "string"}, {"type": "boolean"}
    config = _object(
        [], num_beams={**int_schema(INT32, minimum=1, maximum=16),
                       "description": "> 1: beam search (the text comes whole at the end)"},
        do_sample=boolean, temperature=float_schema(minimum=0, exclusiveMinimum=True),
        top_p=float_schema(minimum=0, maximum=1, exclusiveMinimum=True),
        top_k={**int_schema(INT32, minimum=0), "description": "0: off"},
        max_new_tokens=int_schema(UINT32, minimum=1),
        repetition_penalty=float_schema(minimum=0, exclusiveMinimum=True),
        length_penalty=float_schema(minimum=-10, maximum=10))
    config["additionalProperties"] = False
    for schema in config["properties"].values():
        schema["nullable"] = True
    config["description"] = "a field left out takes the server's default (GET /info)"
    prompt = _object(["request_id", "prompt"], request_id={**string, "minLength": 1},
                     prompt=string)
    prompt["additionalProperties"] = False
    one = _object(["request_id", "prompt"], request_id={**string, "minLength": 1},
                  prompt={**string, "description": "ignored when the id continues a session"},
                  only_new_tokens={**boolean, "default": True},
                  stream_response={**boolean, "default": True},
                  generation_config=_ref("GenerationConfig"))
    one["additionalProperties"] = False
    batch = _object(["prompts"], prompts={"type": "array", "minItems": 1,
                                          "items": _ref("SessionPrompt"),
                                          "description": "at most --max-client-batch-size"},
                    only_new_tokens={**boolean, "default": True},
                    generation_config=_ref("GenerationConfig"))
    batch["additionalProperties"] = False
    return {"GenerationConfig": config, "SessionPrompt": prompt, "GenerateOneRequest": one,
            "GenerateBatchRequest": batch,
            "GenerateBatchAnswer": {"type": "array", "items": _object(
                ["request_id", "response"], request_id=string, response=string,
                prompt={**string, "description": "with only_new_tokens false"})}}


def _generate_one_paths() -> dict:
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/api/generate-one": {"post": {
            "summary": "Generate plain text for a request_id; a known id continues its session",
            "requestBody": {"required": True, **_json(_ref("GenerateOneRequest"))},
            "responses": {"200": {"description": "The text (streamed in chunks with "
                                                 "stream_response)", "content": text},
                          **_errors(409, 413, 422, 424, 429, 503)}}},
        "/api/generate-batch": {"post": {
            "summary": "Generate for several request_ids at once (continuing known ones)",
            "requestBody": {"required": True, **_json(_ref("GenerateBatchRequest"))},
            "responses": {"200": {"description": "One answer per prompt, in order",
                                  **_json(_ref("GenerateBatchAnswer"))},
                          **_errors(409, 413, 422, 424, 429, 503)}}},
    }


def _generate_path() -> dict:
    """TGI's and SGLang's requests share POST /generate: a body with `inputs` is TGI's."""
    sglang_answer = {"oneOf": [_ref("SglangGenerateResponse"),
                               {"type": "array", "items": _ref("SglangGenerateResponse")}]}
    errors = {str(s): {"description": "Error", **_json(
        {"oneOf": [_ref("ErrorResponse"), _ref("SglangErrorResponse")]})}
        for s in (413, 422, 424, 429, 500, 503)}
    return {"post": {
        "summary": "Generate text: TGI's request (`inputs`) or SGLang's (`text` / `input_ids` / "
                   "`input_embeds`; "
                   "`stream: true` answers Server-Sent Events)",
        "requestBody": {"required": True, **_json(
            {"anyOf": [_ref("GenerateRequest"), _ref("SglangGenerateRequest")]})},
        "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": {"anyOf": [_ref("GenerateResponse"), sglang_answer]}},
            "text/event-stream": {"schema": _ref("SglangGenerateResponse")}}}, **errors}}}


def openapi_document() -> dict:
    schemas = {
        "GenerateParameters": _parameters_schema(),
        "GenerateRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"type": "string"}, "parameters": _ref("GenerateParameters")}},
        "CompatGenerateRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"type": "string"}, "parameters": _ref("GenerateParameters"),
            "stream": {"type": "boolean", "default": False}}},
        "Token": _token(True), "PrefillToken": _token(False),
        "Details": _details(best_of=True),
        "BestOfSequence": {**_details(best_of=False), "required": [
            "generated_text", "finish_reason", "generated_tokens", "prefill", "tokens"]},
        "GenerateResponse": {"type": "object", "required": ["generated_text"], "properties": {
            "generated_text": {"type": "string"}, "details": _ref("Details")}},
        "StreamDetails": {"type": "object", "properties": {
            "finish_reason": _FINISH, "generated_tokens": {"type": "integer"},
            "seed": _nullable("integer"), "input_length": {"type": "integer"}}},
        "StreamResponse": {"type": "object", "required": ["index", "token"], "properties": {
            "index": {"type": "integer"}, "token": _ref("Token"),
            "top_tokens": {"type": "array", "items": _ref("Token")},
            "generated_text": _nullable("string"), "details": _ref("StreamDetails")}},
        "SimpleToken": {"type": "object", "required": ["id", "text", "start", "stop"],
                        "properties": {k: {"type": "integer"} if k != "text" else {"type": "string"}
                                       for k in ("id", "text", "start", "stop")}},
        "TokenizeResponse": {"type": "array", "items": _ref("SimpleToken")},
        "ChatTokenizeResponse": _object(["tokenize_response", "templated_text"],
                                        tokenize_response=_ref("TokenizeResponse"),
                                        templated_text={"type": "string"}),
        "Info": {"type": "object", "required": ["model_id", "max_input_tokens", "max_total_tokens",
                                                "router", "version"]},
        "ErrorResponse": _error(),
        **_openai_schemas(),
        **_sglang_schemas(),
        **_generate_one_schemas(),
        **_model_schemas(),
    }
    paths = {
        "/": _post("Generate, streamed (stream: true) or as a list of one response",
                   "CompatGenerateRequest", {"type": "array", "items": _ref("GenerateResponse")},
                   stream_on_request=True),
        "/generate": _generate_path(),
        "/generate_stream": _post("Generate a token stream (Server-Sent Events)", "GenerateRequest",
                                  {}, stream=True),
        "/tokenize": _post("Tokenize inputs", "GenerateRequest", _ref("TokenizeResponse")),
        "/chat_tokenize": _post("Tokenize a chat request: the text its template renders, and its "
                                "tokens", "ChatRequest", _ref("ChatTokenizeResponse")),
        "/invocations": {"post": {
            "summary": "SageMaker's route: a body with `inputs` is served as POST /, one with "
                       "`messages` as chat, one with `prompt` as a completion",
            "requestBody": {"required": True, **_json({"oneOf": [
                _ref("CompatGenerateRequest"), _ref("ChatRequest"),
                _ref("CompletionRequest")]})},
            "responses": {"200": {"description": "OK", "content": {
                **_json({"anyOf": [{"type": "array", "items": _ref("GenerateResponse")},
                                   _ref("ChatCompletion"), _ref("CompletionFinal")]})["content"],
                "text/event-stream": {"schema": _ref("StreamResponse")}}},
                **_errors(413, 422, 424, 429, 500, 503)}}},
        "/health": {"get": {"summary": "Health of the shards", "responses": {
            "200": {"description": "Everything is working fine"}, **_errors(503)}}},
        "/info": {"get": {"summary": "Model and router limits", "responses": {
            "200": {"description": "OK", **_json(_ref("Info"))}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/chat/completions": _post("OpenAI chat completion (stream: true for chunks)",
                                      "ChatRequest", _ref("ChatCompletion"),
                                      stream_on_request=True),
        "/v1/completions": _post("OpenAI text completion (stream: true for chunks)",
                                 "CompletionRequest", _ref("CompletionFinal"),
                                 stream_on_request=True),
        **_model_paths(),
        **_sglang_paths(),
        **_generate_one_paths(),
        "/api-doc/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OK"}}}},
    }
    return {"openapi": "3.0.3",
            "info": {"title": "tgi-py", "version": VERSION,
                     "description": "Text Generation Inference's API, served by tgi-py"},
            "paths": paths, "components": {"schemas": schemas}}
