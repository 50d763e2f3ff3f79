"""The OpenAPI description of the vLLM fields the OpenAI routes serve.

Fields read by router.api.openai.guided and vllm_fields.
"""
from __future__ import annotations

from router.http.openapi import int_schema, nullable
from router.inputs.field_ranges import INT32

_ONE = "a request takes one constraint: two (with response_format, or tools) are a 422"


def request_fields(*, chat: bool) -> dict:
    """vLLM's request fields of the chat (`chat`) or the completions route."""
    fields = dict(
        guided_json={"nullable": True, "oneOf": [{"type": "object"}, {"type": "string"}],
                     "description": f"vLLM's: the output follows this JSON schema; {_ONE}"},
        guided_regex=nullable("string", description="vLLM's: the output matches this regex"),
        guided_choice=nullable("array", items={"type": "string"},
                               description="vLLM's: the output is exactly one of these"),
        guided_grammar=nullable("string", description="vLLM's: the output follows this grammar "
                                                      "(GBNF or Lark)"),
        guided_decoding_backend=nullable(
            "string", description="vLLM's: auto, guidance or llguidance (constraints are "
            "enforced with llguidance), options disable-any-whitespace, "
            "disable-additional-properties, no-fallback; any other is a 422"),
        guided_whitespace_pattern=nullable(
            "string", description="vLLM's: the whitespace JSON output may have between tokens "
            "(a regex; needs a JSON constraint)"),
        structured_outputs=nullable(
            "object", description="vLLM's newer form: exactly one of json, regex, choice, "
            "grammar, json_object (true), structural_tag ({structures: [{begin, schema, end}], "
            "triggers}); options whitespace_pattern, disable_any_whitespace, "
            f"disable_additional_properties, disable_fallback; {_ONE}"),
        prompt_logprobs={**int_schema(INT32, minimum=0), "nullable": True,
                         "description": "vLLM's: the prompt tokens' logprobs, with this many "
                                        "alternatives each (at most --max-top-n-tokens); not "
                                        "with stream"})
    if chat:
        fields.update(
            add_generation_prompt=nullable("boolean", description="vLLM's: end the prompt with "
                                           "the assistant's header (default true)"),
            continue_final_message=nullable("boolean", description="vLLM's: leave the final "
                                            "message open for the model to continue (not with "
                                            "add_generation_prompt true)"))
    return fields


STREAM_OPTIONS = {"type": "object", "nullable": True, "properties": {
    "include_usage": {"type": "boolean", "nullable": True},
    "continuous_usage_stats": {"type": "boolean", "nullable": True,
                               "description": "vLLM's: every chunk carries the usage so far"}}}

# vLLM's answer to prompt_logprobs: null for the first token, then {token id: logprob} a position
PROMPT_LOGPROBS = {"type": "array", "nullable": True, "items": {
    "type": "object", "nullable": True, "additionalProperties": {
        "type": "object", "required": ["logprob", "rank", "decoded_token"], "properties": {
            "logprob": {"type": "number"},
            "rank": {"type": "integer", "nullable": True,
                     "description": "1 for the likeliest; null for a prompt token past the "
                                    "alternatives asked"},
            "decoded_token": {"type": "string"}}}}}
