"""Pieces every API family's part of the OpenAPI document is built from.

router/api/*/openapi.py contribute the parts; router/api/openapi.py assembles them.
"""
from __future__ import annotations

from router.inputs.field_ranges import FLOAT32_MAX, IntType


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}

def nullable(kind: str, **extra) -> dict:
    return {"type": kind, "nullable": True, **extra}

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

FINISH = {"type": "string", "enum": ["length", "eos_token", "stop_sequence"]}

def error_schema() -> dict:
    return {"type": "object", "required": ["error", "error_type"],
            "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}

def json_content(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}

# OpenAI's and SGLang's logit_bias (the /v1 routes also take TGI's list: router.api.openai.openapi)
LOGIT_BIAS = {"type": "object", "nullable": True,
              "description": "token id (a decimal string) -> a bias in [-100, 100] added to its "
                             "logit before any other processing",
              "additionalProperties": float_schema(minimum=-100, maximum=100)}

def error_responses(*statuses: int, shape: str = "ErrorResponse") -> dict:
    return {str(s): {"description": "Error", **json_content(ref(shape))} for s in statuses}

def post(summary: str, request: str, response: dict, *, stream: bool = False,
          stream_on_request: bool = False, event: str = "StreamResponse") -> dict:
    """A generation route: JSON, SSE (`stream`), or either as the body's `stream` field asks.

    `event`: the schema of each SSE event's data."""
    sse = {"text/event-stream": {"schema": ref(event)}}
    content = sse if stream else json_content(response)["content"]
    if stream_on_request:
        content = {**content, **sse}
    return {"post": {"summary": summary, "requestBody": {"required": True, **json_content(ref(request))},
                     "responses": {"200": {"description": "OK", "content": content},
                                   **error_responses(413, 422, 424, 429, 500, 503)}}}

def object_schema(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


# the error body an OpenAI SDK (its x-stainless-* headers) gets on every /v1 route
# (router.api.openai.errors.openai_error_body); `code` is TGI's error_type
def sdk_error_schema() -> dict:
    return object_schema(["error"], error=object_schema(
        ["message", "type", "param", "code"], message={"type": "string"},
        type={"type": "string", "enum": ["invalid_request_error", "authentication_error",
                                         "rate_limit_exceeded", "server_error"]},
        param=nullable("string", description="the request field at fault, where known"),
        code={"type": "string"}))


def or_sdk_error(paths: dict) -> dict:
    """`paths` with each /v1 route's errors also in OpenAI SDK's body.

    Each error answer is either in the route's own body or, to an OpenAI SDK, in OpenAISDKError."""
    for path, operations in paths.items():
        if not path.startswith("/v1/"):
            continue
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    content = response["content"]["application/json"]
                    content["schema"] = {"oneOf": [content["schema"], ref("OpenAISDKError")]}
    return paths
