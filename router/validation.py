"""TGI generate parameters -> a validated GenerateRequest, with TGI's limits and messages."""
from __future__ import annotations

import random
from dataclasses import dataclass

from router.config import TokenLimits
from router.errors import ValidationError
from router.schemas import GenerateRequest, SamplingParams, StoppingParams
from router.tokenizer import RouterTokenizer

DEFAULT_MAX_NEW_TOKENS = 100


@dataclass(slots=True)
class ValidationLimits:
    tokens: TokenLimits
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int


def _number(params: dict, name: str, kind=float):
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"`{name}` must be a number")
    if kind is int and (not float(value).is_integer()):
        raise ValidationError(f"`{name}` must be an integer")
    return kind(value)


def _flag(params: dict, name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValidationError(f"`{name}` must be a boolean")
    return value


def sampling_params(params: dict) -> SamplingParams:
    """Sampling fields with TGI's rules; greedy unless do_sample, a random seed when sampling."""
    temperature = _number(params, "temperature")
    if temperature is not None and temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition = _number(params, "repetition_penalty")
    if repetition is not None and repetition <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency = _number(params, "frequency_penalty")
    if frequency is not None and not -2.0 <= frequency <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    top_p = _number(params, "top_p")
    if top_p is not None and not 0.0 < top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    typical_p = _number(params, "typical_p")
    if typical_p is not None and not 0.0 < typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    top_k = _number(params, "top_k", int)
    if top_k is not None and top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    seed = _number(params, "seed", int)
    if seed is not None and not 0 <= seed < 2**64:
        raise ValidationError("`seed` must be between 0 and 2^64 - 1")
    do_sample = _flag(params, "do_sample", False)
    return SamplingParams(
        temperature=temperature or 1.0, top_k=top_k or 0, top_p=top_p or 1.0,
        typical_p=typical_p or 1.0, repetition_penalty=repetition or 1.0,
        frequency_penalty=frequency or 0.0, do_sample=do_sample,
        seed=seed if seed is not None else random.getrandbits(63),
        watermark=_flag(params, "watermark", False))


def stop_sequences(params: dict, limits: ValidationLimits) -> list[str]:
    stop = params.get("stop") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValidationError("`stop` must be a list of strings")
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(stop)}")
    return [s for s in stop if s]


async def validate_generate(body: dict, tokenizer: RouterTokenizer, limits: ValidationLimits,
                            *, stream: bool = False) -> tuple[GenerateRequest, dict]:
    """The TGI body {inputs, parameters} -> (request, the raw parameters for the response layer)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise ValidationError("`inputs` must be a string")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError("`parameters` must be an object")
    for unsupported in ("grammar", "adapter_id"):
        if params.get(unsupported) is not None:
            raise ValidationError(f"`{unsupported}` is not supported yet by this server")
    if _flag(params, "watermark", False):
        raise ValidationError("`watermark` is not supported yet by this server")
    best_of = _number(params, "best_of", int)
    if best_of is not None and best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported yet by this server")
    if stream and _flag(params, "decoder_input_details", False):
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    sampling = sampling_params(params)
    max_new_tokens = _number(params, "max_new_tokens", int)
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    top_n = _number(params, "top_n_tokens", int) or 0
    if not 0 <= top_n <= limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                              f"Given: {top_n}")
    stop = stop_sequences(params, limits)
    if not inputs:
        raise ValidationError("`inputs` cannot be empty")
    token_limits = limits.tokens
    truncate = _number(params, "truncate", int)
    if truncate is not None and not 0 < truncate <= token_limits.max_input_tokens:
        raise ValidationError(f"`truncate` must be strictly positive and less than "
                              f"{token_limits.max_input_tokens}. Given: {truncate}")
    input_ids = await tokenizer.encode_async(inputs)
    if truncate is not None:
        input_ids = input_ids[-truncate:]
    if not input_ids:
        raise ValidationError("`inputs` cannot be empty")
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, token_limits.max_total_tokens - len(input_ids))
    if len(input_ids) + max_new_tokens > token_limits.max_total_tokens:
        raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= "
                              f"{token_limits.max_total_tokens}. Given: {len(input_ids)} `inputs` "
                              f"tokens and {max_new_tokens} `max_new_tokens`")
    if len(input_ids) > token_limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {token_limits.max_input_tokens} tokens. "
                              f"Given: {len(input_ids)}")
    request = GenerateRequest(
        inputs=inputs, input_ids=input_ids, sampling=sampling,
        stopping=StoppingParams(max_new_tokens=max_new_tokens, stop_sequences=stop),
        top_n_tokens=top_n, prefill_logprobs=_flag(params, "decoder_input_details", False))
    return request, params
