"""Ollama's `options` -> our sampling and stopping, each option mapped or refused with a reason.

Ollama's defaults (its Modelfile's: temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1)
apply to what a request leaves out, as an Ollama client expects: the same request samples alike
here and there. `repeat_penalty` is TGI's multiplicative repetition penalty, applied over the
whole sequence (Ollama's `repeat_last_n: -1`); presence and frequency penalties are OpenAI's
additive ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.errors import ValidationError
from router.inputs.field_ranges import FLOAT32_MAX, read_number
from router.inputs.seeds import seed_or_draw
from router.inputs.stop_text import stop_strings
from router.inputs.validation import ValidationLimits
from router.schemas import SamplingParams

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}

# options that tune how a runner loads or runs the model, not what it generates: here they are
# the model's start settings (PATCH /v1/models/<id>: ngl, n_parallel, cpu_threads)
_LOAD_OPTIONS = ("num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock",
                 "numa", "low_vram", "vocab_only", "f16_kv", "logits_all", "num_keep")
# sampling options of llama.cpp's this server has no counterpart for: accepted at their
# no-effect value only
_NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "repeat_last_n": -1,
            "penalize_newline": True}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "num_predict", "stop",
             "repeat_penalty", "presence_penalty", "frequency_penalty", "num_ctx")


@dataclass(frozen=True, slots=True)
class Options:
    """What a request's options ask for: sampling, stop strings, token budget, context size."""

    sampling: SamplingParams
    stop: list[str]
    num_predict: int | None  # None: as many as the context leaves (Ollama's -1 and -2)
    num_ctx: int | None  # None: the model's whole context


def read_options(options, limits: ValidationLimits) -> Options:
    """`options` (an object or null) read; a 400 naming the first option that cannot be served."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ValidationError("`options` must be an object")
    for key, value in options.items():
        if key in _SAMPLING:
            continue
        if key in _LOAD_OPTIONS:
            raise ValidationError(f"option `{key}` is not supported: how a model runs is set "
                                  "when it starts (PATCH /v1/models/<id> settings), not per "
                                  "request")
        if key in _NEUTRAL:
            if value == _NEUTRAL[key] or value is None:
                continue
            raise ValidationError(f"option `{key}` is not supported: this server has no such "
                                  f"sampler (only {_NEUTRAL[key]!r}, its neutral value)")
        raise ValidationError(f"option `{key}` is not supported")
    given = {key: value for key, value in options.items() if value is not None}
    values = {**DEFAULTS, **given}
    temperature = _number(values, "temperature", 0, 100)
    seed = _number(values, "seed", -1, 2**64 - 1, integer=True)
    sampling = SamplingParams(
        temperature=temperature or 1.0, do_sample=temperature != 0,
        top_k=_number(values, "top_k", 0, 2**31 - 1, integer=True),
        top_p=_number(values, "top_p", 0, 1, low_open=True),
        min_p=_number(values, "min_p", 0, 1) or 0.0,
        repetition_penalty=_number(values, "repeat_penalty", 0, FLOAT32_MAX, low_open=True),
        presence_penalty=_number(values, "presence_penalty", -2, 2) or 0.0,
        frequency_penalty=_number(values, "frequency_penalty", -2, 2) or 0.0,
        seed=seed_or_draw(None if seed == -1 else seed))  # llama.cpp's -1: a random seed
    num_predict = _number(values, "num_predict", -2, 2**31 - 1, integer=True)
    if num_predict == 0:
        raise ValidationError("option `num_predict` must be positive, or -1 (no limit)")
    num_ctx = _number(values, "num_ctx", 1, 2**31 - 1, integer=True)
    if num_ctx is not None and num_ctx > limits.tokens.max_total_tokens:
        raise ValidationError(f"option `num_ctx` {num_ctx} is more than this model's context "
                              f"here ({limits.tokens.max_total_tokens} tokens, "
                              "--max-total-tokens)")
    return Options(sampling, stop_strings(values.get("stop"), "option `stop`", limits.max_stop_sequences),
                   num_predict if num_predict is not None and num_predict > 0 else None, num_ctx)


def _number(values: dict, name: str, low, high, *, integer: bool = False,
            low_open: bool = False):
    return read_number(values, name, low, high, integer=integer, low_open=low_open,
                       path=f"options.{name}")


def token_budget(options: Options, input_length: int, limits: ValidationLimits) -> int:
    """max_new_tokens: num_predict, within the room num_ctx (or the model's context) leaves."""
    context = options.num_ctx or limits.tokens.max_total_tokens
    if input_length > limits.tokens.max_input_tokens or input_length >= context:
        raise ValidationError(f"the prompt is {input_length} tokens: more than the "
                              f"{min(context - 1, limits.tokens.max_input_tokens)} this "
                              "request's context leaves room for")
    room = context - input_length
    return min(options.num_predict, room) if options.num_predict is not None else room
