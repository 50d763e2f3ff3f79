"""The OpenAPI document of what this router serves, built from the same names the code uses."""
from __future__ import annotations

from router.validation import PARAMETER_TYPES

VERSION = "0.1.0"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(kind: str, **extra) -> dict:
    return {"type": kind, "nullable": True, **extra}


_PARAMETER_LIMITS = {
    "best_of": {"minimum": 0, "exclusiveMinimum": True},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "max_new_tokens": {"minimum": 0, "default": 100},
    "repetition_penalty": {"minimum": 0, "exclusiveMinimum": True},
    "temperature": {"minimum": 0, "exclusiveMinimum": True},
    "top_k": {"minimum": 0, "exclusiveMinimum": True},
    "top_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "typical_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "stop": {"items": {"type": "string"}, "maxItems": 4},
}


def _parameters_schema() -> dict:
    properties = {}
    for name, kind in sorted(PARAMETER_TYPES.items()):
        properties[name] = _nullable(kind, **_PARAMETER_LIMITS.get(name, {}))
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


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "Error", **_json(_ref("ErrorResponse"))} for s in statuses}


def _post(summary: str, request: str, response: dict, *, stream: bool = False) -> dict:
    content = {"text/event-stream": {"schema": _ref("StreamResponse")}} if stream else \
        _json(response)["content"]
    return {"post": {"summary": summary, "requestBody": {"required": True, **_json(_ref(request))},
                     "responses": {"200": {"description": "OK", "content": content},
                                   **_errors(422, 424, 429, 500)}}}


def _object(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


def _openai_schemas() -> dict:
    string, integer = {"type": "string"}, {"type": "integer"}
    envelope = dict(id=string, object=string, created=integer, model=string,
                    system_fingerprint=string)
    usage = _ref("Usage")
    return {
        "Usage": _object(["prompt_tokens", "completion_tokens", "total_tokens"],
                         prompt_tokens=integer, completion_tokens=integer, total_tokens=integer),
        "ChatRequest": _object(["messages"], model=string, messages={"type": "array", "items": {
            "type": "object", "required": ["role"]}}, max_tokens=_nullable("integer"),
            temperature=_nullable("number"), top_p=_nullable("number"), n=_nullable("integer"),
            seed=_nullable("integer"), stream={"type": "boolean"}, tools=_nullable("array"),
            tool_choice={}, response_format=_nullable("object"), logprobs=_nullable("boolean"),
            top_logprobs=_nullable("integer")),
        "ChatCompletion": _object(["id", "created", "model", "system_fingerprint", "choices",
                                   "usage"], **envelope, usage=usage,
                                  choices={"type": "array", "items": _object(
                                      ["index", "message", "finish_reason"], index=integer,
                                      message={"type": "object"}, finish_reason=string,
                                      logprobs=_nullable("object"))}),
        "CompletionRequest": _object(["prompt"], model=string, prompt={}, suffix=_nullable("string"),
                                     echo=_nullable("boolean"), max_tokens=_nullable("integer"),
                                     logprobs=_nullable("integer"), stream={"type": "boolean"}),
        "CompletionFinal": _object(["id", "created", "model", "system_fingerprint", "choices",
                                    "usage"], **envelope, usage=usage,
                                   choices={"type": "array", "items": _object(
                                       ["index", "text", "finish_reason"], index=integer,
                                       text=string, finish_reason=string,
                                       logprobs=_nullable("object"))}),
        "ModelList": _object(["object", "data"], object=string, data={"type": "array", "items": (
            _object(["id", "object", "created", "owned_by"], id=string, object=string,
                    created=integer, owned_by=string))}),
    }


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
        "Info": {"type": "object", "required": ["model_id", "max_input_tokens", "max_total_tokens",
                                                "router", "version"]},
        "ErrorResponse": _error(),
        **_openai_schemas(),
    }
    paths = {
        "/": _post("Generate, streamed (stream: true) or as a list of one response",
                   "CompatGenerateRequest", {"type": "array", "items": _ref("GenerateResponse")}),
        "/generate": _post("Generate text", "GenerateRequest", _ref("GenerateResponse")),
        "/generate_stream": _post("Generate a token stream (Server-Sent Events)", "GenerateRequest",
                                  {}, stream=True),
        "/tokenize": _post("Tokenize inputs", "GenerateRequest", _ref("TokenizeResponse")),
        "/health": {"get": {"summary": "Health of the shards", "responses": {
            "200": {"description": "Everything is working fine"}, **_errors(503)}}},
        "/info": {"get": {"summary": "Model and router limits", "responses": {
            "200": {"description": "OK", **_json(_ref("Info"))}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/chat/completions": _post("OpenAI chat completion (stream: true for chunks)",
                                      "ChatRequest", _ref("ChatCompletion")),
        "/v1/completions": _post("OpenAI text completion (stream: true for chunks)",
                                 "CompletionRequest", _ref("CompletionFinal")),
        "/v1/models": {"get": {"summary": "The model served", "responses": {
            "200": {"description": "OK", **_json(_ref("ModelList"))}}}},
        "/api-doc/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OK"}}}},
    }
    return {"openapi": "3.0.3",
            "info": {"title": "tgi-py", "version": VERSION,
                     "description": "Text Generation Inference's API, served by tgi-py"},
            "paths": paths, "components": {"schemas": schemas}}
