"""The generate-one/batch API's bodies -> validated calls, with the server's defaults filled in.

`generation_config` is read by router.inputs.generation_config; a field the API does not define is
a 422.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.errors import ValidationError
from router.inputs.field_ranges import check_fields, read_flag
from router.inputs.generation_config import GenerationConfig, GenerationDefaults, parse_config

# characters of a request_id: an id names a session, it does not carry data
MAX_REQUEST_ID = 1024


@dataclass(frozen=True, slots=True)
class Prompt:
    request_id: str
    prompt: str


@dataclass(frozen=True, slots=True)
class OneCall:
    prompt: Prompt
    only_new_tokens: bool
    stream_response: bool
    config: GenerationConfig


@dataclass(frozen=True, slots=True)
class BatchCall:
    prompts: list[Prompt]
    only_new_tokens: bool
    config: GenerationConfig


def _prompt(item: dict, prefix: str) -> Prompt:
    request_id, prompt = item.get("request_id"), item.get("prompt")
    if not isinstance(request_id, str) or not request_id:
        raise ValidationError(f"`{prefix}request_id` is required: a non-empty string")
    if len(request_id) > MAX_REQUEST_ID:  # the server keeps it as long as the session
        raise ValidationError(f"`{prefix}request_id` must be at most {MAX_REQUEST_ID} characters. "
                              f"Given: {len(request_id)}")
    if not isinstance(prompt, str):
        raise ValidationError(f"`{prefix}prompt` is required: a string")
    return Prompt(request_id, prompt)


def parse_one(body: dict, defaults: GenerationDefaults) -> OneCall:
    check_fields(body, {"request_id", "prompt", "only_new_tokens", "stream_response",
                         "generation_config"}, "the request")
    prompt = _prompt(body, "")
    return OneCall(prompt, read_flag(body, "only_new_tokens", True),
                   read_flag(body, "stream_response", True),
                   parse_config(body.get("generation_config"), defaults))


def parse_batch(body: dict, defaults: GenerationDefaults, max_prompts: int) -> BatchCall:
    check_fields(body, {"prompts", "only_new_tokens", "generation_config"}, "the request")
    items = body.get("prompts")
    if not isinstance(items, list) or not items:
        raise ValidationError("`prompts` is required: a non-empty list of {request_id, prompt}")
    if len(items) > max_prompts:
        raise ValidationError(f"Number of prompts exceeds the maximum allowed batch size of "
                              f"{max_prompts}")
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(f"`prompts[{i}]` must be an object with `request_id` and "
                                  "`prompt`")
        check_fields(item, {"request_id", "prompt"}, f"`prompts[{i}]`")
        prompts.append(_prompt(item, f"prompts[{i}]."))
    ids = [p.request_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValidationError("`prompts` names a request_id twice")
    return BatchCall(prompts, read_flag(body, "only_new_tokens", True),
                     parse_config(body.get("generation_config"), defaults))
