"""The generate-one/batch API's bodies -> validated calls, with the server's defaults filled in.

`generation_config` takes transformers' names (num_beams, do_sample, temperature, top_p, top_k,
max_new_tokens, repetition_penalty, length_penalty); a field left out takes the server's default
(GenerationDefaults: launcher flags, their environment variables, or a .env file). Numbers go through
router.wire's checks as on the other APIs; a field the API does not define is a 422.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace

from router.errors import ValidationError
from router.schemas import SamplingParams
from router.wire import INT32, UINT32, check_float, check_int, flag

MAX_BEAMS = 16  # each beam may hold a whole sequence of KV blocks
MAX_LENGTH_PENALTY = 10.0  # length^penalty stays a finite float for any context length


# characters of a request_id: an id names a session, it does not carry data
MAX_REQUEST_ID = 1024


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a call gets for a generation_config field it leaves out (transformers' defaults)."""

    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int | None = None  # None: whatever room the context leaves
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    num_beams: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int | None
    repetition_penalty: float
    length_penalty: float

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            repetition_penalty=self.repetition_penalty, do_sample=self.do_sample,
            seed=random.getrandbits(64))


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


_CONFIG_FIELDS = {f.name for f in fields(GenerationConfig)}


def _check_fields(body: dict, allowed: set[str], where: str) -> None:
    for name in body:
        if name not in allowed:
            raise ValidationError(f"`{name}` is not a field of {where}")


def parse_config(value, defaults: GenerationDefaults) -> GenerationConfig:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValidationError("`generation_config` must be an object")
    _check_fields(value, _CONFIG_FIELDS, "`generation_config`")
    given = {k: v for k, v in value.items() if v is not None}
    config = GenerationConfig(**asdict(defaults))
    out = {}
    if "num_beams" in given:
        out["num_beams"] = check_int("generation_config.num_beams", given["num_beams"], INT32)
    if "do_sample" in given:
        if not isinstance(given["do_sample"], bool):
            raise ValidationError("`generation_config.do_sample` must be a boolean")
        out["do_sample"] = given["do_sample"]
    for name in ("temperature", "top_p", "repetition_penalty", "length_penalty"):
        if name in given:
            out[name] = check_float(f"generation_config.{name}", given[name])
    if "top_k" in given:
        out["top_k"] = check_int("generation_config.top_k", given["top_k"], INT32)
    if "max_new_tokens" in given:
        out["max_new_tokens"] = check_int("generation_config.max_new_tokens",
                                          given["max_new_tokens"], UINT32)
    config = replace(config, **out)
    check_config(config)
    return config


def check_config(config: GenerationConfig | GenerationDefaults) -> None:
    def bad(name: str, rule: str, value) -> ValidationError:
        return ValidationError(f"`generation_config.{name}` must be {rule}. Given: {value}")

    if config.num_beams < 1:
        raise bad("num_beams", ">= 1", config.num_beams)
    if config.num_beams > MAX_BEAMS:
        raise bad("num_beams", f"<= {MAX_BEAMS}", config.num_beams)
    if config.num_beams > 1 and config.repetition_penalty != 1.0:
        raise ValidationError("`generation_config.repetition_penalty` other than 1 with "
                              "`num_beams` > 1 is not supported yet")
    if not config.temperature > 0:
        raise bad("temperature", "> 0", config.temperature)
    if not 0 < config.top_p <= 1:
        raise bad("top_p", "> 0 and <= 1", config.top_p)
    if config.top_k < 0:
        raise bad("top_k", ">= 0 (0: off)", config.top_k)
    if config.max_new_tokens is not None and config.max_new_tokens < 1:
        raise bad("max_new_tokens", ">= 1", config.max_new_tokens)
    if not config.repetition_penalty > 0:
        raise bad("repetition_penalty", "> 0", config.repetition_penalty)
    if not -MAX_LENGTH_PENALTY <= config.length_penalty <= MAX_LENGTH_PENALTY:
        raise bad("length_penalty", f">= -{MAX_LENGTH_PENALTY} and <= {MAX_LENGTH_PENALTY}",
                  config.length_penalty)


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
    _check_fields(body, {"request_id", "prompt", "only_new_tokens", "stream_response",
                         "generation_config"}, "the request")
    prompt = _prompt(body, "")
    return OneCall(prompt, flag(body, "only_new_tokens", True),
                   flag(body, "stream_response", True),
                   parse_config(body.get("generation_config"), defaults))


def parse_batch(body: dict, defaults: GenerationDefaults, max_prompts: int) -> BatchCall:
    _check_fields(body, {"prompts", "only_new_tokens", "generation_config"}, "the request")
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
        _check_fields(item, {"request_id", "prompt"}, f"`prompts[{i}]`")
        prompts.append(_prompt(item, f"prompts[{i}]."))
    ids = [p.request_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValidationError("`prompts` names a request_id twice")
    return BatchCall(prompts, flag(body, "only_new_tokens", True),
                     parse_config(body.get("generation_config"), defaults))
