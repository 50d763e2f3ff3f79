"""The chat and completion objects of TGI's document, as the /v1 routes take and answer them.

Named as TGI 2.2.1's document names them. Where it and OpenAI's API differ on what is sent, the
description says which one this server follows and why (docs/apis.md lists them).
"""
from __future__ import annotations

from router.api.openai.vllm_openapi import PROMPT_LOGPROBS
from router.http.openapi import nullable, object_schema, ref

_STRING, _INTEGER = {"type": "string"}, {"type": "integer", "minimum": 0}


def _envelope(obj: str, choice: str, *, usage: str) -> dict:
    """An answer's or chunk's envelope: ids, times and choices of `choice`.

    `usage`: "required", "optional" (a stream's last chunk with include_usage) or "none"."""
    required = ["id", "created", "model", "system_fingerprint", "choices"]
    properties = dict(id=_STRING, object={"type": "string", "enum": [obj]},
                      created={"type": "integer", "format": "int64", "minimum": 0},
                      model=_STRING, system_fingerprint=_STRING,
                      choices={"type": "array", "items": ref(choice)})
    if usage != "none":
        properties["usage"] = ref("Usage") if usage == "required" else {
            "allOf": [ref("Usage")], "nullable": True,
            "description": "with stream_options.include_usage, in a last chunk of no choices"}
    if usage == "required":
        required.append("usage")
    return object_schema(required, **properties)


def _logprob_schemas() -> dict:
    top = object_schema(["token", "logprob"], token=_STRING, logprob={"type": "number"},
                        bytes={"type": "array", "items": _INTEGER})
    return {
        "ChatCompletionTopLogprob": top,
        "ChatCompletionLogprob": {**top, "required": ["token", "logprob", "top_logprobs"],
                                  "properties": {**top["properties"], "top_logprobs": {
                                      "type": "array", "items": ref("ChatCompletionTopLogprob")}}},
        "ChatCompletionLogprobs": object_schema(["content"], content={
            "type": "array", "items": ref("ChatCompletionLogprob")}),
    }


def _request_message_schemas() -> dict:
    """What a chat request's messages and tools are made of."""
    return {
        "Url": object_schema(["url"], url={**_STRING, "description": (
            "a data: URL (data:image/png;base64,...), an http(s) URL the server fetches "
            "(unless --disable-image-fetch), or a file:// URL under "
            "--allowed-local-media-path")}),
        "MessageChunk": {"oneOf": [
            object_schema(["text", "type"], text=_STRING,
                          type={"type": "string", "enum": ["text"]}),
            {**object_schema(["image_url", "type"],
                             image_url={"oneOf": [ref("Url"), _STRING]},
                             type={"type": "string", "enum": ["image_url"]}),
             "description": "an image, for a model that takes images (GET /info's "
                            "takes_images); a model that reads text only refuses it (a 422)"}]},
        "MessageContent": {"oneOf": [_STRING, {"type": "array", "items": ref("MessageChunk")}]},
        "Message": object_schema(
            ["role"], role={"type": "string", "enum": ["system", "developer", "user", "assistant",
                                                       "tool"]},
            content={"allOf": [ref("MessageContent")], "nullable": True,
                     "description": "null only in an assistant turn that called tools"},
            name=nullable("string"), tool_call_id=nullable("string"),
            tool_calls={"type": "array", "items": ref("ToolCall"), "nullable": True},
            reasoning_content=nullable("string")),
        "FunctionDefinition": object_schema(
            ["name"], name=_STRING, description=nullable("string"),
            parameters={"type": "object", "nullable": True,
                        "description": "the JSON schema of its arguments (TGI also reads it "
                                       "as `arguments`)"},
            arguments={"description": "in a call: its arguments, a JSON object's text as "
                                      "OpenAI writes it (TGI 2.2.1 wrote the object)"}),
        "FunctionName": object_schema(["name"], name=_STRING),
        "Tool": object_schema(["type", "function"], type={"type": "string", "enum": ["function"]},
                              function=ref("FunctionDefinition")),
        "ToolCall": object_schema(["id", "type", "function"], id=_STRING, type=_STRING,
                                  function=ref("FunctionDefinition")),
        "ToolType": {"oneOf": [
            {"type": "string", "description": "auto, none, required, or the name of the one "
                                              "function to call (TGI's form)"},
            object_schema(["function"], type={"type": "string", "enum": ["function"]},
                          function=ref("FunctionName"))]},
        "ToolChoice": {"allOf": [ref("ToolType")], "nullable": True},
    }


def _with(schema: dict, **properties) -> dict:
    """`schema` with more (optional) properties."""
    return {**schema, "properties": {**schema["properties"], **properties}}


def _answer_schemas() -> dict:
    """What the chat and completion routes answer, whole and streamed."""
    text_message = object_schema(["role", "content"], role=_STRING, content=_STRING,
                                 reasoning_content=nullable(
                                     "string", description="with --reasoning-parser: the "
                                     "model's thinking (content: the answer after it)"))
    return {
        "TextMessage": text_message,
        "ToolCallMessage": object_schema(["role", "tool_calls"], role=_STRING,
                                         content=nullable("string"),
                                         tool_calls={"type": "array", "items": ref("ToolCall")}),
        # anyOf: an answer may say words beside its calls
        "OutputMessage": {"anyOf": [ref("TextMessage"), ref("ToolCallMessage")]},
        "ChatCompletionComplete": object_schema(
            ["index", "message", "finish_reason"], index=_INTEGER, message=ref("OutputMessage"),
            finish_reason=_STRING,
            logprobs={"allOf": [ref("ChatCompletionLogprobs")], "nullable": True}),
        "ChatCompletion": _with(_envelope("chat.completion", "ChatCompletionComplete",
                                          usage="required"), prompt_logprobs=PROMPT_LOGPROBS),
        "Function": object_schema([], name=nullable("string"), arguments=_STRING),
        "DeltaToolCall": {**object_schema(["index"], index=_INTEGER, id=_STRING, type=_STRING,
                                          function=ref("Function")),
                          "description": "a call's id, type and name come in its first delta, "
                                         "its arguments' text after them, as OpenAI streams it"},
        "ToolCallDelta": {**object_schema(["tool_calls"], role=_STRING,
                                          content=nullable("string"),
                                          tool_calls={"type": "array",
                                                      "items": ref("DeltaToolCall")}),
                          "description": "a list of calls, each with its `index`, as OpenAI "
                                         "(and TGI 3) send them; TGI 2.2.1's document has one"},
        "ChatCompletionDelta": {"anyOf": [
            object_schema([], role=_STRING, content=nullable("string"),
                          reasoning_content=nullable("string")),
            ref("ToolCallDelta")]},
        "ChatCompletionChoice": object_schema(
            ["index", "delta"], index=_INTEGER, delta=ref("ChatCompletionDelta"),
            finish_reason=nullable("string"),
            logprobs={"allOf": [ref("ChatCompletionLogprobs")], "nullable": True}),
        "ChatCompletionChunk": _envelope("chat.completion.chunk", "ChatCompletionChoice",
                                         usage="optional"),
        "CompletionComplete": object_schema(
            ["index", "text", "finish_reason"], index=_INTEGER, text=_STRING,
            prompt_logprobs=PROMPT_LOGPROBS,
            finish_reason={"type": "string", "description": "\"\" until a streamed choice ends"},
            logprobs={"type": "object", "nullable": True, "description": (
                "with `logprobs`, OpenAI's legacy object (tokens, token_logprobs, top_logprobs, "
                "text_offset); TGI's document types it a list of floats, and TGI always sends "
                "null"), "properties": {
                    "tokens": {"type": "array", "items": _STRING},
                    "token_logprobs": {"type": "array", "items": nullable("number")},
                    "top_logprobs": {"type": "array", "items": {"type": "object"}},
                    "text_offset": {"type": "array", "items": _INTEGER}}}),
        "Chunk": _envelope("text_completion", "CompletionComplete", usage="optional"),
        "CompletionFinal": _envelope("text_completion", "CompletionComplete", usage="required"),
        "Completion": {"anyOf": [ref("Chunk"), ref("CompletionFinal")],
                       "description": "a completion, whole or a streamed chunk"},
        "Prompt": {"oneOf": [_STRING, {"type": "array", "items": _STRING, "minItems": 1}],
                   "description": "one prompt, or several (TGI's document lists only the list)"},
    }


def schemas() -> dict:
    return {**_logprob_schemas(), **_request_message_schemas(), **_answer_schemas()}
