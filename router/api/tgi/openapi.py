"""TGI's part of the OpenAPI document: its generate parameters, responses and routes."""
from __future__ import annotations

from router.http.openapi import (FINISH, error_responses, error_schema, float_schema, int_schema,
                                 json_content, nullable, post, ref)
from router.inputs.validation import INTEGER_WIRE_TYPES, PARAMETER_TYPES

# documented bounds (TGI's rules, checked in router.inputs.validation); the integers' ranges and formats
# come from the wire types they travel in
_PARAMETER_LIMITS = {
    "best_of": {"minimum": 0, "exclusiveMinimum": True},
    "max_new_tokens": {"minimum": 0, "exclusiveMinimum": True, "default": 100},
    "repetition_penalty": {"minimum": 0, "exclusiveMinimum": True},
    "temperature": {"minimum": 0, "exclusiveMinimum": True},
    "top_k": {"minimum": 0, "exclusiveMinimum": True},
    "top_n_tokens": {"minimum": 0},
    "truncate": {"minimum": 0, "exclusiveMinimum": True},
    "top_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "typical_p": {"minimum": 0, "maximum": 1, "exclusiveMinimum": True, "exclusiveMaximum": True},
    "stop": {"items": {"type": "string"}, "maxItems": 4},
    "frequency_penalty": {"minimum": -2, "maximum": 2, "description": (
        "TGI's: subtracted from a token's logit times its share of the sequence so far (its "
        "occurrences in the prompt and output / their length); not OpenAI's per occurrence")},
    "adapter_id": {"description": "a loaded LoRA adapter's name (GET /info lists them); null or "
                                  "\"\" is the base model; a name not loaded is a 422 (TGI "
                                  "would use the base model)"},
}


def _parameters_schema() -> dict:
    properties = {}
    for name, kind in sorted(PARAMETER_TYPES.items()):
        limits = _PARAMETER_LIMITS.get(name, {})
        if name == "grammar":
            properties[name] = {"allOf": [ref("GrammarType")], "nullable": True}
        elif kind == "integer":
            properties[name] = {**int_schema(INTEGER_WIRE_TYPES[name], **limits), "nullable": True}
        elif kind == "number":
            properties[name] = {**float_schema(**limits), "nullable": True}
        else:
            properties[name] = nullable(kind, **limits)
    return {"type": "object", "properties": properties}


def _grammar_type() -> dict:
    """TGI's grammar forms: 2.2.1's json and regex, and TGI 3's json_schema.

    As router.inputs.structured_output.from_tgi reads them."""
    def form(kind: str, value: dict) -> dict:
        return {"type": "object", "required": ["type", "value"], "properties": {
            "type": {"type": "string", "enum": kind}, "value": value}}
    return {"oneOf": [
        form(["json", "json_object"], {"description": "a JSON schema, or its text"}),
        form(["regex"], {"type": "string"}),
        form(["json_schema"], {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "schema": {"description": "the JSON schema"}}})]}


def _token(with_special: bool) -> dict:
    props = {"id": {"type": "integer"}, "text": {"type": "string"},
             "logprob": nullable("number")}
    if with_special:
        props["special"] = {"type": "boolean"}
    return {"type": "object", "required": list(props), "properties": props}


def _details(best_of: bool) -> dict:
    props = {
        "finish_reason": ref("FinishReason"), "generated_tokens": {"type": "integer"},
        "seed": nullable("integer"),
        "prefill": {"type": "array", "items": ref("PrefillToken")},
        "tokens": {"type": "array", "items": ref("Token")},
        "top_tokens": {"type": "array", "items": {"type": "array", "items": ref("Token")}},
    }
    if best_of:
        props["best_of_sequences"] = {"type": "array", "items": ref("BestOfSequence")}
    return {"type": "object", "required": ["finish_reason", "generated_tokens", "prefill", "tokens"],
            "properties": props}


def _generate_path() -> dict:
    """TGI's and SGLang's requests share POST /generate: a body with `inputs` is TGI's."""
    sglang_answer = {"oneOf": [ref("SglangGenerateResponse"),
                               {"type": "array", "items": ref("SglangGenerateResponse")}]}
    errors = {str(s): {"description": "Error", **json_content(
        {"oneOf": [ref("ErrorResponse"), ref("SglangErrorResponse")]})}
        for s in (400, 413, 422, 424, 429, 500, 503)}  # 400: SGLang's, an adapter not loaded
    return {"post": {
        "summary": "Generate text: TGI's request (`inputs`) or SGLang's (`text` / `input_ids` / "
                   "`input_embeds`; "
                   "`stream: true` answers Server-Sent Events)",
        "requestBody": {"required": True, **json_content(
            {"anyOf": [ref("GenerateRequest"), ref("SglangGenerateRequest")]})},
        "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": {"anyOf": [ref("GenerateResponse"), sglang_answer]}},
            "text/event-stream": {"schema": ref("SglangGenerateResponse")}}}, **errors}}}


def schemas() -> dict:
    return {
        "GenerateParameters": _parameters_schema(),
        "GrammarType": _grammar_type(), "FinishReason": FINISH,
        "GenerateRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"type": "string"}, "parameters": ref("GenerateParameters")}},
        "CompatGenerateRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"type": "string"}, "parameters": ref("GenerateParameters"),
            "stream": {"type": "boolean", "default": False}}},
        "Token": _token(True), "PrefillToken": _token(False),
        "Details": _details(best_of=True),
        "BestOfSequence": {**_details(best_of=False), "required": [
            "generated_text", "finish_reason", "generated_tokens", "prefill", "tokens"]},
        "GenerateResponse": {"type": "object", "required": ["generated_text"], "properties": {
            "generated_text": {"type": "string"},
            "details": {"allOf": [ref("Details")], "nullable": True}}},
        "StreamDetails": {"type": "object", "properties": {
            "finish_reason": FINISH, "generated_tokens": {"type": "integer"},
            "seed": nullable("integer"), "input_length": {"type": "integer"}}},
        "StreamResponse": {"type": "object", "required": ["index", "token"], "properties": {
            "index": {"type": "integer"}, "token": ref("Token"),
            "top_tokens": {"type": "array", "items": ref("Token")},
            "generated_text": nullable("string"),
            "details": {"allOf": [ref("StreamDetails")], "nullable": True}}},
        "SimpleToken": {"type": "object", "required": ["id", "text", "start", "stop"],
                        "properties": {k: {"type": "integer"} if k != "text" else {"type": "string"}
                                       for k in ("id", "text", "start", "stop")}},
        "TokenizeResponse": {"type": "array", "items": ref("SimpleToken")},
        "Info": {"type": "object", "required": ["model_id", "max_input_tokens", "max_total_tokens",
                                                "router", "version"],
                 "properties": {"model_architecture": {
                     "type": "string", "example": "LlamaForCausalLM",
                     "description": "The config.json architecture the shards serve (not in "
                                    "TGI's /info)"},
                     "quantization": {
                         **nullable("string"),
                         "example": "gguf Q4_K_M: Q4_K in 100 layers (int4 kernel), Q6_K in "
                                    "29 layers (int8 kernel)",
                         "description": "How the weights are held where not in model_dtype: a "
                                        "GGUF's types as served, or --quantize's form; null: all "
                                        "in model_dtype (not in TGI's /info)"},
                     "takes_images": {
                         "type": "boolean",
                         "description": "Whether a request may hold images (a vision-language "
                                        "model; not in TGI's /info)"},
                     "lora_adapters": {
                         "type": "array", "items": ref("LoraAdapterInfo"),
                         "description": "The LoRA adapters loaded (not in TGI's /info); a "
                                        "request names one by its name"},
                     "max_loras": {
                         "type": "integer", "minimum": 0,
                         "description": "LoRA adapters the model holds at once (--max-loras; "
                                        "not in TGI's /info)"}}},
        "LoraAdapterInfo": {
            "type": "object",
            "required": ["name", "parent", "source", "rank", "alpha", "target_modules"],
            "properties": {
                "name": {"type": "string"},
                "parent": {"type": "string", "description": "the base model's id"},
                "source": {"type": "string", "description": "the path or Hub id it came from"},
                "path": {"type": "string", "description": "the directory the shards read"},
                "rank": {"type": "integer"}, "alpha": {"type": "number"},
                "scaling": {"type": "number", "description": "alpha / rank, or alpha / "
                                                             "sqrt(rank) with rsLoRA"},
                "target_modules": {"type": "array", "items": {"type": "string"}},
                "base_model": {"type": "string", "description": "its config's "
                                                                "base_model_name_or_path"},
                "created": {"type": "integer"}}},
        "ErrorResponse": error_schema(),
        **_embed_schemas(),
    }


def _embed_schemas() -> dict:
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    text = {"type": "string"}
    return {
        "EmbedRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"oneOf": [text, {"type": "array", "items": text}, ids,
                                 {"type": "array", "items": ids}]},
            "normalize": {"type": "boolean", "default": True},
            "truncate": {"type": "boolean", "default": False},
            "truncation_direction": {"type": "string", "enum": ["Right", "Left"]},
            "dimensions": {"type": "integer", "minimum": 1},
            "prompt_name": {"type": "string", "nullable": True,
                            "description": "refused: no prompts are configured"}}},
        "EmbedResponse": {"type": "array", "items": {"type": "array",
                                                     "items": {"type": "number"}}},
    }


def paths() -> dict:
    return {
        "/": post("Generate, streamed (stream: true) or as a list of one response",
                   "CompatGenerateRequest", {"type": "array", "items": ref("GenerateResponse")},
                   stream_on_request=True),
        "/generate": _generate_path(),
        "/generate_stream": post("Generate a token stream (Server-Sent Events)", "GenerateRequest",
                                  {}, stream=True),
        "/tokenize": post("Tokenize inputs", "GenerateRequest", ref("TokenizeResponse")),
        "/embed": _embed_path(),
        "/health": {"get": {"summary": "Health of the shards", "responses": {
            "200": {"description": "Everything is working fine"}, **error_responses(404, 503)}}},
        "/info": {"get": {"summary": "Model and router limits", "responses": {
            "200": {"description": "OK", **json_content(ref("Info"))}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }


def _embed_path() -> dict:
    path = post("text-embeddings-inference's embed: one vector per input (400 for a model that "
                "does not embed)", "EmbedRequest", ref("EmbedResponse"))
    path["post"]["responses"].update(error_responses(400, 404, 409))
    return path
