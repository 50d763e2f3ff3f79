"""SGLang's part of the OpenAPI document: its /generate body and its companion routes."""
from __future__ import annotations

from router.http.openapi import (LOGIT_BIAS, error_responses, float_schema, int_schema,
                                 json_content, object_schema, ref)
from router.inputs.field_ranges import INT32, UINT32, UINT64


def _sglang_schemas() -> dict:
    """SGLang's native /generate (router.api.sglang.request checks these bounds)."""
    string, boolean = {"type": "string"}, {"type": "boolean"}
    token_id = int_schema(UINT32)
    strings = {"oneOf": [string, {"type": "array", "items": string}]}
    sampling = object_schema(
        [], max_new_tokens={**int_schema(UINT32), "default": 128, "description": (
            "0 scores the prompt: no output tokens, the prompt's log-probabilities with "
            "return_logprob and logprob_start_len >= 0")},
        stream_interval={**int_schema(UINT32, minimum=1), "default": 1,
                         "description": "a streamed event every this many tokens, and the last"},
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
    image = {"oneOf": [string, object_schema(["url"], url=string)]}
    request = object_schema(
        [], text=strings,
        input_ids={"oneOf": [{"type": "array", "items": token_id, "minItems": 1},
                             {"type": "array", "minItems": 1, "items": {
                                 "type": "array", "items": token_id, "minItems": 1}}]},
        sampling_params={"oneOf": [ref("SglangSamplingParams"),
                                   {"type": "array", "items": ref("SglangSamplingParams")}]},
        rid=strings, stream={**boolean, "description": (
            "SSE events of the text so far; meta_info's per-token lists (log-probabilities, "
            "hidden states) hold only the tokens each event adds, the prompt's in the first")},
        return_logprob=per_prompt(boolean),
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
            "as the first entry, then one vector per later token")},
        lora_path={**per_prompt({**string, "nullable": True}), "description": (
            "the LoRA adapter to generate with: a loaded adapter's name, or the directory it "
            "was loaded from; for a batch, one for every prompt or a list of one per prompt "
            "(null: the base model). One not loaded is a 400")},
        lora_id={**per_prompt({**string, "nullable": True}), "description": (
            "a loaded LoRA adapter's name (as lora_path takes it); with lora_path, both must "
            "name the same adapter")},
        image_data={"description": (
            "for a model that takes images (GET /info's takes_images), with `text`: an image "
            "(a data: or http(s) URL, a file path under --allowed-local-media-path, plain "
            "base64, or {\"url\": ...}) or a list of them for one prompt; for a batch, one "
            "entry (an image, a list or null) per prompt. Each goes where the text writes the "
            "model's image marker (Gemma 3: <start_of_image>), or first when it writes none"),
            "oneOf": [image, {"type": "array", "items": {"nullable": True, "oneOf": [
                image, {"type": "array", "items": image}]}}]},
        modalities={"type": "array", "items": {"type": "string",
                                               "enum": ["image", "multi-images"]}})
    request["anyOf"] = [{"required": ["text"]}, {"required": ["input_ids"]},
                        {"required": ["input_embeds"]}]
    logprob = {"type": "array", "items": {}, "minItems": 3, "maxItems": 3,
               "description": "[logprob or null, token id, text or null]"}
    meta = object_schema(["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
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
        "SglangGenerateResponse": object_schema(["text", "meta_info"], text=string,
                                          meta_info=ref("SglangMetaInfo"),
                                          index={"type": "integer"}),
        "SglangErrorResponse": object_schema(["error"], error=object_schema(
            ["message"], message=string, type=string, code={"type": "integer"})),
        "AbortRequest": object_schema([], rid=string, abort_all=boolean),
    }


def _sglang_paths() -> dict:
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    ok_json = lambda name: {"200": {"description": "OK", **json_content(ref(name))}}  # noqa: E731
    return {
        "/abort_request": {"post": {
            "summary": "SGLang: cancel the running request named `rid` (or all, `abort_all`)",
            "requestBody": {"required": True, **json_content(ref("AbortRequest"))},
            "responses": {"200": {"description": "Aborted, or no such request running"},
                          **error_responses(400, 413, shape="SglangErrorResponse")}}},
        "/flush_cache": {"post": {
            "summary": "SGLang: drop the prefix cache (400 while requests are in flight)",
            "responses": {"200": {"description": "Flushed", **text},
                          "400": {"description": "Requests are in flight", **text}}}},
        "/health_generate": {"get": {
            "summary": "SGLang: health, generating one token", "responses": {
                "200": {"description": "A token was generated"}, **error_responses(503)}}},
        "/get_model_info": {"get": {"summary": "SGLang: the model served", "responses": {
            "200": {"description": "OK", **json_content(object_schema(
                ["model_path", "is_generation"], model_path={"type": "string"},
                tokenizer_path={"type": "string"}, is_generation={"type": "boolean"},
                hidden_size={"type": "integer"}))}}}},
        "/get_server_info": {"get": {"summary": "SGLang: server settings and limits",
                                     "responses": ok_json("Info")}},
    }


def schemas() -> dict:
    return _sglang_schemas()


def paths() -> dict:
    return _sglang_paths()
