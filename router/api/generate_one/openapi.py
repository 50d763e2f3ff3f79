"""generate-one's part of the OpenAPI document: /api/generate-one and /api/generate-batch."""
from __future__ import annotations

from router.http.openapi import (error_responses, float_schema, int_schema, json_content,
                                 object_schema, ref)
from router.inputs.field_ranges import INT32, UINT32


def _generate_one_schemas() -> dict:
    """/api/generate-one|batch (router.api.generate_one.request checks these bounds)."""
    string, boolean = {"type": "string"}, {"type": "boolean"}
    config = object_schema(
        [], num_beams={**int_schema(INT32, minimum=1, maximum=16),
                       "description": "> 1: beam search (the text comes whole at the end)"},
        do_sample=boolean, temperature=float_schema(minimum=0, exclusiveMinimum=True),
        top_p=float_schema(minimum=0, maximum=1, exclusiveMinimum=True),
        top_k={**int_schema(INT32, minimum=0), "description": "0: off"},
        max_new_tokens=int_schema(UINT32, minimum=1),
        repetition_penalty=float_schema(minimum=0, exclusiveMinimum=True),
        length_penalty=float_schema(minimum=-10, maximum=10),
        adapter_id={**string, "description": (
            "ours, not in the spec: a loaded LoRA adapter's name (\"\": the base model; a name "
            "not loaded is a 422). A session keeps the adapter it started with: a later call "
            "leaves this out or names the same one, else a 422")})
    config["additionalProperties"] = False
    for schema in config["properties"].values():
        schema["nullable"] = True
    config["description"] = "a field left out takes the server's default (GET /info)"
    prompt = object_schema(["request_id", "prompt"], request_id={**string, "minLength": 1},
                     prompt=string)
    prompt["additionalProperties"] = False
    one = object_schema(["request_id", "prompt"], request_id={**string, "minLength": 1},
                  prompt={**string, "description": "ignored when the id continues a session"},
                  only_new_tokens={**boolean, "default": True},
                  stream_response={**boolean, "default": True},
                  generation_config=ref("GenerationConfig"))
    one["additionalProperties"] = False
    batch = object_schema(["prompts"], prompts={"type": "array", "minItems": 1,
                                          "items": ref("SessionPrompt"),
                                          "description": "at most --max-client-batch-size"},
                    only_new_tokens={**boolean, "default": True},
                    generation_config=ref("GenerationConfig"))
    batch["additionalProperties"] = False
    return {"GenerationConfig": config, "SessionPrompt": prompt, "GenerateOneRequest": one,
            "GenerateBatchRequest": batch,
            "GenerateBatchAnswer": {"type": "array", "items": object_schema(
                ["request_id", "response"], request_id=string, response=string,
                prompt={**string, "description": "with only_new_tokens false"})}}


def _generate_one_paths() -> dict:
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/api/generate-one": {"post": {
            "summary": "Generate plain text for a request_id; a known id continues its session",
            "requestBody": {"required": True, **json_content(ref("GenerateOneRequest"))},
            "responses": {"200": {"description": "The text (streamed in chunks with "
                                                 "stream_response)", "content": text},
                          **error_responses(409, 413, 422, 424, 429, 503)}}},
        "/api/generate-batch": {"post": {
            "summary": "Generate for several request_ids at once (continuing known ones)",
            "requestBody": {"required": True, **json_content(ref("GenerateBatchRequest"))},
            "responses": {"200": {"description": "One answer per prompt, in order",
                                  **json_content(ref("GenerateBatchAnswer"))},
                          **error_responses(409, 413, 422, 424, 429, 503)}}},
    }


def schemas() -> dict:
    return _generate_one_schemas()


def paths() -> dict:
    return _generate_one_paths()
