"""OpenAI's part of the OpenAPI document: chat and legacy completions, and /chat_tokenize."""
from __future__ import annotations

from router.api.openai import openapi_messages
from router.http.openapi import (LOGIT_BIAS, error_responses, float_schema, int_schema, nullable,
                                 object_schema, or_sdk_error, post, ref, sdk_error_schema)
from router.api.openai import vllm_openapi
from router.inputs.field_ranges import INT32, UINT32, UINT64

# OpenAI's map, or TGI's document's list of floats (the i-th biases token id i)
_LOGIT_BIAS = {"nullable": True, "anyOf": [
    {k: v for k, v in LOGIT_BIAS.items() if k != "nullable"},
    {"type": "array", "items": float_schema(minimum=-100, maximum=100),
     "description": "TGI's form: the i-th bias for token id i"}]}

# TGI's grammar forms, or OpenAI's response_format (text, json_object, json_schema)
_RESPONSE_FORMAT = {"nullable": True, "anyOf": [ref("GrammarType"), object_schema(
    ["type"], type={"type": "string", "enum": ["text", "json_object", "json_schema"]},
    json_schema=object_schema(["schema"], name={"type": "string"}, schema={"type": "object"},
                              strict=nullable("boolean")))]}


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
        min_p={**float_schema(minimum=0, maximum=1), "nullable": True,
               "description": "vLLM's extension: tokens less likely than min_p times the "
                              "likeliest are dropped; 0 is off"},
        stop_token_ids={"type": "array", "nullable": True, "items": int_schema(UINT32),
                        "description": "vLLM's extension: generation ends on any of these "
                                       "token ids"},
        n={**int_schema(INT32, minimum=1), "nullable": True},
        seed={**int_schema(UINT64), "nullable": True},
        frequency_penalty={**float_schema(minimum=-2, maximum=2), "nullable": True},
        presence_penalty={**float_schema(minimum=-2, maximum=2), "nullable": True},
        repetition_penalty={**float_schema(minimum=0, exclusiveMinimum=True), "nullable": True,
                            "description": "vLLM's extension: TGI's multiplicative penalty, "
                                           "1 is off"},
        logit_bias=_LOGIT_BIAS,
        stop={"nullable": True, "oneOf": [{"type": "string"},
                                          {"type": "array", "items": {"type": "string"}}]},
        stream={"type": "boolean", "nullable": True},
        stream_options=vllm_openapi.STREAM_OPTIONS)


# `model` of both routes' requests (and of their answers)
_MODEL = {"type": "string", "description": (
    "a served model's id, or a loaded LoRA adapter's name: then its base model generates with the "
    "adapter, and the answer's `model` is the adapter's name (as vLLM answers). While one model "
    "runs, a name that is neither is that model; once several run, a 404 model_not_found")}


def _openai_schemas() -> dict:
    integer = {"type": "integer"}
    completion_sampling = _openai_sampling()
    completion_sampling["max_tokens"] = {**completion_sampling["max_tokens"], "default": 32,
                                         "description": "TGI's default (OpenAI's is 16)"}
    return {
        "Usage": object_schema(["prompt_tokens", "completion_tokens", "total_tokens"],
                         prompt_tokens=integer, completion_tokens=integer, total_tokens=integer),
        "ChatRequest": object_schema(
            ["messages"], model=_MODEL, messages={"type": "array", "items": ref("Message"),
                                                  "minItems": 1},
            **_openai_sampling(),
            logprobs=nullable("boolean"), top_logprobs={**int_schema(INT32, minimum=0),
                                                         "nullable": True},
            tools={"type": "array", "items": ref("Tool"), "nullable": True},
            tool_choice=ref("ToolChoice"),
            tool_prompt=nullable("string", description="TGI's: the words before the offered "
                                                       "tools where the template cannot show "
                                                       "them"),
            response_format=_RESPONSE_FORMAT,
            chat_template_kwargs=nullable(
                "object", additionalProperties=True,
                description="vLLM's and SGLang's extension: more variables for the model's chat "
                            "template, e.g. {\"enable_thinking\": false} for Qwen3's; they may "
                            "replace the special tokens (bos_token, ...), not messages, tools, "
                            "add_generation_prompt, continue_final_message, chat_template or "
                            "tokenize (a 422)"),
            **vllm_openapi.request_fields(chat=True)),
        "CompletionRequest": object_schema(["prompt"], model=_MODEL, prompt=ref("Prompt"),
                                     suffix=nullable("string"),
                                     echo=nullable("boolean"), **completion_sampling,
                                     logprobs={**int_schema(INT32, minimum=0), "nullable": True},
                                     best_of={**int_schema(INT32, minimum=1), "nullable": True,
                                              "description": "candidates per prompt (at most "
                                                             "--max-best-of, at least n; not "
                                                             "with stream)"},
                                     response_format=_RESPONSE_FORMAT,
                                     **vllm_openapi.request_fields(chat=False)),
    }


def schemas() -> dict:
    return {
        **_openai_schemas(), **openapi_messages.schemas(),
        "OpenAISDKError": sdk_error_schema(),
        **_embedding_schemas(),
        "ChatTokenizeResponse": object_schema(["tokenize_response", "templated_text"],
                                              tokenize_response=ref("TokenizeResponse"),
                                              templated_text={"type": "string"}),
    }


def _embedding_schemas() -> dict:
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    text = {"type": "string"}
    sglang_item = object_schema(["text"], text=text)
    number = {"type": "number"}
    return {
        "EmbeddingRequest": object_schema(
            ["input"], model=text,
            input={"oneOf": [text, {"type": "array", "items": text}, ids,
                             {"type": "array", "items": ids},
                             {"type": "array", "items": sglang_item}],
                   "description": "a string, strings, token ids, lists of token ids, or "
                                  "SGLang's objects with `text`"},
            encoding_format={"type": "string", "enum": ["float", "base64"]},
            dimensions={"type": "integer", "minimum": 1, "description": (
                "a prefix of the embedding, renormalized: only for a model declaring "
                "Matryoshka embeddings (else 400 unless its full width)")},
            user=text, normalize={"type": "boolean", "description": "vLLM's; default: as the "
                                                                     "model declares"},
            truncate_prompt_tokens={"type": "integer", "description": (
                "vLLM's: keep each input's last k tokens; -1: as many as the model embeds")}),
        "EmbeddingResponse": object_schema(
            ["object", "data", "model", "usage"], object={"type": "string", "enum": ["list"]},
            model=text,
            data={"type": "array", "items": object_schema(
                ["object", "index", "embedding"], object={"type": "string"},
                index={"type": "integer"},
                embedding={"oneOf": [{"type": "array", "items": number}, text]})},
            usage=object_schema(["prompt_tokens", "total_tokens"],
                                prompt_tokens={"type": "integer"},
                                total_tokens={"type": "integer"})),
    }


def _by_model(path: dict) -> dict:
    """A route whose `model` picks the model or adapter, with its 404 and 409.

    404 when it names none of them, 409 when the model is not running."""
    path["post"]["responses"].update(error_responses(404, 409))
    return path


def paths() -> dict:
    return or_sdk_error({
        "/chat_tokenize": _by_model(post(
            "Tokenize a chat request: the text its template renders, and its tokens",
            "ChatRequest", ref("ChatTokenizeResponse"))),
        "/v1/chat/completions": _by_model(post(
            "OpenAI chat completion (stream: true for chunks; `model` may name a LoRA adapter)",
            "ChatRequest", ref("ChatCompletion"), stream_on_request=True,
            event="ChatCompletionChunk")),
        "/v1/completions": _by_model(post(
            "OpenAI text completion (stream: true for chunks; `model` may name a LoRA adapter)",
            "CompletionRequest", ref("CompletionFinal"), stream_on_request=True, event="Chunk")),
        "/v1/embeddings": _by_model(_embedding_post()),
    })


def _embedding_post() -> dict:
    path = post("OpenAI embeddings (also SGLang's and vLLM's); 400 for a model that does not "
                "embed", "EmbeddingRequest", ref("EmbeddingResponse"))
    path["post"]["responses"].update(error_responses(400))
    return path
