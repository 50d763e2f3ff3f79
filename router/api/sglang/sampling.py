"""SGLang's `sampling_params` object -> the sampling and stopping a request asks, checked."""
from __future__ import annotations

from dataclasses import dataclass

from router.errors import ValidationError
from router.inputs import structured_output
from router.inputs.field_ranges import (F32, INT32, UINT32, UINT64, check_logit_bias,
                                        checked_token_ids, read_flag, read_number)
from router.inputs.seeds import seed_or_draw
from router.inputs.stop_text import stop_strings
from router.inputs.validation import ValidationLimits
from router.schemas import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

_SAMPLING_NOT_YET = {
    "structural_tag": "`structural_tag` is not supported yet (json_schema, regex and ebnf are)",
    "custom_params": "`custom_params` is refused: it feeds a custom logit processor, which this "
                     "server never runs",
}
_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "json_schema", "regex", "ebnf", "sampling_seed", "logit_bias", "stream_interval",
    *_SAMPLING_NOT_YET,
}


def _sampling_number(params: dict, name: str, wire, default, low=None, high=None, *,
                     low_open: bool = False):
    return read_number(params, name, low, high, default=default, low_open=low_open,
                       path=f"sampling_params.{name}", wire=wire)


@dataclass(slots=True)
class SglangSampling:
    """What one sampling_params dict asks, before the prompt's length is known."""

    sampling: SamplingParams
    max_new_tokens: int | None  # None: SGLang's default, within what the prompt leaves
    stop: list[str]
    stop_token_ids: list[int]
    min_new_tokens: int
    n: int
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    grammar: tuple[str, str] | None
    seeded: bool  # the client gave sampling_seed
    stream_interval: int = 1  # a streamed frame every this many tokens


def parse_sampling(params, limits: ValidationLimits, max_n: int, vocab_size: int) -> SglangSampling:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValidationError("`sampling_params` must be an object or a list of objects")
    for name, value in params.items():
        if name not in _SAMPLING_FIELDS:
            raise ValidationError(f"`sampling_params.{name}` is not a field of SGLang's sampling "
                                  "parameters")
        if name in _SAMPLING_NOT_YET and value is not None:
            raise ValidationError(_SAMPLING_NOT_YET[name])
    # either value gives the same text, as on SGLang with a fast tokenizer: its decoder joins
    # special tokens as it joins any other, so there is no space to put or leave out
    read_flag(params, "spaces_between_special_tokens", True,
              path="sampling_params.spaces_between_special_tokens")
    temperature = _sampling_number(params, "temperature", F32, 1.0, 0, 3.4e38)
    top_k = _sampling_number(params, "top_k", INT32, -1)
    if top_k != -1 and top_k < 1:
        raise ValidationError(f"`sampling_params.top_k` must be -1 (off) or at least 1. "
                              f"Given: {top_k}")
    seed = _sampling_number(params, "sampling_seed", UINT64, None)
    sampling = SamplingParams(
        temperature=temperature if temperature > 0 else 1.0,
        top_k=0 if top_k == -1 else top_k,
        top_p=_sampling_number(params, "top_p", F32, 1.0, 0, 1, low_open=True),
        min_p=_sampling_number(params, "min_p", F32, 0.0, 0, 1),
        frequency_penalty=_sampling_number(params, "frequency_penalty", F32, 0.0, -2, 2),
        presence_penalty=_sampling_number(params, "presence_penalty", F32, 0.0, -2, 2),
        repetition_penalty=_sampling_number(params, "repetition_penalty", F32, 1.0, 0, 2, low_open=True),
        # SGLang: temperature 0 (or top_k 1) is greedy; anything else samples
        do_sample=temperature > 0 and top_k != 1,
        seed=seed_or_draw(seed),
        logit_bias=check_logit_bias("sampling_params.logit_bias", params.get("logit_bias"),
                                    limits.vocab_size))
    max_new_tokens = _sampling_number(params, "max_new_tokens", UINT32, None)  # 0: scoring
    min_new_tokens = _sampling_number(params, "min_new_tokens", UINT32, 0)
    if min_new_tokens > (DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens):
        raise ValidationError("`sampling_params.min_new_tokens` must be <= `max_new_tokens`")
    stop = stop_strings(params.get("stop"), "`sampling_params.stop`", limits.max_stop_sequences)
    stop_ids = params.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list):
        raise ValidationError("`sampling_params.stop_token_ids` must be a list of token ids")
    n = _sampling_number(params, "n", UINT32, 1)
    if not 1 <= n <= max_n:
        raise ValidationError(f"`sampling_params.n` must be >= 1 and <= {max_n}. Given: {n}")
    constraints = [k for k in ("json_schema", "regex", "ebnf") if params.get(k) is not None]
    if len(constraints) > 1:
        raise ValidationError("only one of `json_schema`, `regex` or `ebnf` may be given")
    spec = None
    if params.get("json_schema") is not None:
        if not isinstance(params["json_schema"], str):
            raise ValidationError("`sampling_params.json_schema` must be a string holding a JSON "
                                  "schema")
        spec = structured_output.checked(structured_output.JSON, params["json_schema"])
    elif params.get("regex") is not None:
        spec = structured_output.checked(structured_output.REGEX, params["regex"])
    elif params.get("ebnf") is not None:
        spec = structured_output.checked(structured_output.EBNF, params["ebnf"])
    path = "sampling_params"
    interval = _sampling_number(params, "stream_interval", UINT32, 1)
    if interval < 1:
        raise ValidationError("`sampling_params.stream_interval` must be at least 1")
    return SglangSampling(
        sampling, max_new_tokens, stop,
        checked_token_ids(stop_ids, f"{path}.stop_token_ids", vocab_size), min_new_tokens, n,
        read_flag(params, "ignore_eos", False, path=f"{path}.ignore_eos"),
        read_flag(params, "skip_special_tokens", True, path=f"{path}.skip_special_tokens"),
        read_flag(params, "no_stop_trim", False, path=f"{path}.no_stop_trim"), spec, seed is not None,
        interval)

