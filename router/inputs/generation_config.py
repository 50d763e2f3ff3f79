"""transformers' `generation_config` as generate-one takes it.

It holds the server's defaults and a call's values.

A field left out takes the server's default (GenerationDefaults: launcher flags, their environment
variables, or a .env file); numbers go through field_ranges' checks as on the other APIs.
`adapter_id` (a LoRA adapter's name) is ours: the spec has no such field, and no default.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from router.errors import ValidationError
from router.inputs.field_ranges import INT32, UINT32, check_fields, check_float, check_int
from router.inputs.seeds import draw_seed
from router.schemas import SamplingParams

MAX_BEAMS = 16  # each beam may hold a whole sequence of KV blocks
MAX_LENGTH_PENALTY = 10.0  # length^penalty stays a finite float for any context length


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
    # extension: a loaded LoRA adapter's name, "" for the base model; None (left out) is the
    # base model on a new session and the session's own adapter on a later call
    adapter_id: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            repetition_penalty=self.repetition_penalty, do_sample=self.do_sample,
            seed=draw_seed())


_CONFIG_FIELDS = {f.name for f in fields(GenerationConfig)}


def parse_config(value, defaults: GenerationDefaults) -> GenerationConfig:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValidationError("`generation_config` must be an object")
    check_fields(value, _CONFIG_FIELDS, "`generation_config`")
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
    if "adapter_id" in given:
        if not isinstance(given["adapter_id"], str):
            raise ValidationError("`generation_config.adapter_id` must be a string: a loaded "
                                  "LoRA adapter's name")
        out["adapter_id"] = given["adapter_id"]
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


