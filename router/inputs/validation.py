"""TGI generate parameters -> a validated GenerateRequest, with TGI's rules, order and messages.

Field types are checked first (a wrong type is a 422 like any other validation error), then the rules
in the order TGI applies them, then the prompt is tokenised and its length checked.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from router.errors import UnknownAdapterError, ValidationError
from router.inputs.field_ranges import INT32, UINT32, UINT64, check_float, check_int
from router.inputs.images.family import ImageFamily
from router.inputs.images.placement import markdown_prompt, placed
from router.inputs.images.sources import MediaLimits
from router.inputs.seeds import seed_or_draw
from router.inputs.structured_output import from_tgi
from router.inputs.tokenizer import RouterTokenizer
from router.schemas import GenerateRequest, SamplingParams, StoppingParams



class AdapterRegistry(Protocol):
    """What validation reads of a served model's adapters (router.lifecycle.adapters)."""

    def check(self, name: str) -> None: ...  # UnknownAdapterError for a name not loaded

DEFAULT_MAX_NEW_TOKENS = 100

# GenerateParameters field -> JSON type; every field may also be null
PARAMETER_TYPES = {
    "adapter_id": "string", "best_of": "integer", "decoder_input_details": "boolean",
    "details": "boolean", "do_sample": "boolean", "frequency_penalty": "number",
    "grammar": "object", "max_new_tokens": "integer", "repetition_penalty": "number",
    "return_full_text": "boolean", "seed": "integer", "stop": "array", "temperature": "number",
    "top_k": "integer", "top_n_tokens": "integer", "top_p": "number", "truncate": "integer",
    "typical_p": "number", "watermark": "boolean",
    # extension (vLLM and SGLang have it): keep generating past EOS, for benchmarks
    "ignore_eos": "boolean",
}
# the Rust type of each integer field in TGI's GenerateParameters (usize is 64-bit); every one of
# them also fits the protobuf field that carries it to the shards (top_k > 0 fits its uint32)
INTEGER_WIRE_TYPES = {"best_of": UINT64, "max_new_tokens": UINT32, "seed": UINT64,
                      "top_k": INT32, "top_n_tokens": UINT32, "truncate": UINT64}


@dataclass(slots=True)
class TokenLimits:
    """A model's token limits (router/lifecycle/limits.py resolves them at start)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int


@dataclass(slots=True)
class ValidationLimits:
    tokens: TokenLimits
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    vocab_size: int = 0  # the model's (its LM head's rows; 0: unknown)


@dataclass(slots=True)
class ValidatedGenerate:
    request: GenerateRequest
    best_of: int
    details: bool
    return_full_text: bool | None  # None: the route's default
    decoder_input_details: bool

    def output_prefix(self, full_text_default: bool) -> str:
        """What goes before the generated text: the prompt when full text is asked."""
        full = self.return_full_text if self.return_full_text is not None else full_text_default
        return self.request.inputs if full else ""


def _type_error(path: str, value, expected: str) -> ValidationError:
    return ValidationError(f"Failed to deserialize the JSON body into the target type: {path}: "
                           f"invalid type: {type(value).__name__} {value!r}, expected {expected}")


def check_types(params: dict) -> dict:
    """Returns the parameters with nulls removed; raises on a value of the wrong JSON type."""
    checked = {}
    for name, value in params.items():
        kind = PARAMETER_TYPES.get(name)
        if kind is None or value is None:
            continue  # unknown fields are ignored, as TGI's parser does
        path = f"parameters.{name}"
        if kind == "boolean" and not isinstance(value, bool):
            raise _type_error(path, value, "a boolean")
        if kind == "number":
            value = check_float(path, value)
        if kind == "integer":
            value = check_int(path, value, INTEGER_WIRE_TYPES[name])
        if kind == "string" and not isinstance(value, str):
            raise _type_error(path, value, "a string")
        if kind == "object" and not isinstance(value, dict):
            raise _type_error(path, value, "an object")
        if kind == "array" and (not isinstance(value, list)
                                or not all(isinstance(s, str) for s in value)):
            raise _type_error(path, value, "a list of strings")
        checked[name] = value
    return checked


def _sampling(params: dict, limits: ValidationLimits, best_of: int) -> SamplingParams:
    temperature = params.get("temperature")
    top_k, top_p, typical_p = params.get("top_k"), params.get("top_p"), params.get("typical_p")
    wants_sampling = params.get("do_sample", False) or any(
        v is not None for v in (temperature, top_k, top_p, typical_p))
    if best_of > 1 and not wants_sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if temperature is not None and temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition = params.get("repetition_penalty")
    if repetition is not None and repetition <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency = params.get("frequency_penalty")
    if frequency is not None and not -2.0 <= frequency <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if top_p is not None and not 0.0 < top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if typical_p is not None and not 0.0 < typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if top_k is not None and top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    return SamplingParams(
        temperature=temperature or 1.0, top_k=top_k or 0, top_p=top_p or 1.0,
        typical_p=typical_p or 1.0, repetition_penalty=repetition or 1.0,
        frequency_penalty=frequency or 0.0, frequency_by_share=True,  # TGI's formula
        # greedy unless asked, TGI's rule: do_sample, or a warper other than its default (a
        # temperature other than 1, any top_k, top_p or typical_p); best_of > 1 samples
        do_sample=bool(params.get("do_sample", False)) or best_of > 1
        or (temperature is not None and temperature != 1.0)
        or any(v is not None for v in (top_k, top_p, typical_p)),
        watermark=bool(params.get("watermark", False)))


def _best_of(params: dict, limits: ValidationLimits, stream: bool) -> int:
    best_of = params.get("best_of")
    if best_of is None:
        return 1
    if best_of != 1 and limits.max_best_of == 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
    if not 0 < best_of <= limits.max_best_of:
        raise ValidationError(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
    if best_of > 1 and stream:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    return best_of


def chosen_adapter(name: str | None, adapters: AdapterRegistry | None) -> str | None:
    """The LoRA adapter a request names (None: the base model).

    None for None or "", else a loaded adapter's name; UnknownAdapterError (a 422) for a name the
    model has not loaded. TGI falls back to the base model for an unknown id; we refuse it, since an
    answer from the wrong weights would look like a right one (docs/apis.md)."""
    if not name:
        return None
    if adapters is None:  # a model without a registry has loaded none
        raise UnknownAdapterError(name, [])
    adapters.check(name)
    return name


async def validate_generate(body: dict, tokenizer: RouterTokenizer, limits: ValidationLimits,
                            *, stream: bool = False,
                            adapters: AdapterRegistry | None = None,
                            images: ImageFamily | None = None,
                            media: MediaLimits = MediaLimits()) -> ValidatedGenerate:
    """The TGI body {inputs, parameters} -> a validated request.

    The request is one the batcher can schedule; `adapters`: the served model's, which
    `parameters.adapter_id` must name one of; `images`: the model's image family, whose
    prompts' `![](url)` are images read within `media` (None: a text model, for which they are
    text, as in TGI)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise _type_error("inputs", inputs, "a string") if "inputs" in body else \
            ValidationError("Failed to deserialize the JSON body into the target type: missing "
                            "field `inputs`")
    raw = body.get("parameters")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):  # [], "", 0 and false too, as serde refuses them
        raise _type_error("parameters", raw, "an object")
    params = check_types(raw)
    adapter_id = chosen_adapter(params.get("adapter_id"), adapters)
    grammar = None
    if params.get("grammar") is not None:  # compiling one may take a while: off the event loop
        grammar = await asyncio.to_thread(from_tgi, params["grammar"])
    best_of = _best_of(params, limits, stream)
    decoder_input_details = params.get("decoder_input_details", False)
    if stream and decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming "
                              "tokens")
    sampling = _sampling(params, limits, best_of)
    max_new_tokens = params.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    stop = params.get("stop") or []
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(stop)}")
    seed = params.get("seed")
    if seed is not None and best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    if seed is not None and seed >= 2**64:
        raise ValidationError("`seed` must be less than 2^64")
    sampling.seed = seed_or_draw(seed)
    top_n = params.get("top_n_tokens") or 0
    if top_n > limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                              f"Given: {top_n}")
    if not inputs:
        raise ValidationError("`inputs` cannot be empty")
    text, loaded = inputs, []
    if images is not None:
        text, loaded = await markdown_prompt(inputs, images, media, "`inputs`")
    input_ids = await tokenize_prompt(text, params.get("truncate"), tokenizer, limits.tokens)
    placed_images = placed(input_ids, images, loaded) if loaded else []
    max_new_tokens = check_lengths(len(input_ids), max_new_tokens, limits.tokens)
    request = GenerateRequest(
        inputs=inputs, input_ids=input_ids, sampling=sampling,
        stopping=StoppingParams(max_new_tokens=max_new_tokens, stop_sequences=[s for s in stop if s],
                                ignore_eos=bool(params.get("ignore_eos", False))),
        top_n_tokens=top_n, prefill_logprobs=decoder_input_details, grammar=grammar,
        adapter_id=adapter_id, images=placed_images)
    return ValidatedGenerate(request, best_of, details=bool(params.get("details", False)),
                             return_full_text=params.get("return_full_text"),
                             decoder_input_details=decoder_input_details)


async def tokenize_prompt(inputs: str, truncate: int | None, tokenizer: RouterTokenizer,
                    limits: TokenLimits) -> list[int]:
    if truncate is not None and not 0 < truncate <= limits.max_input_tokens:
        raise ValidationError(f"`truncate` must be strictly positive and less than "
                              f"{limits.max_input_tokens}. Given: {truncate}")
    # with truncate, a longer text is allowed: its last tokens are kept
    input_ids = await tokenizer.encode_async(
        inputs, max_tokens=limits.max_input_tokens if truncate is None else None)
    if truncate is not None:
        input_ids = input_ids[-truncate:]
    if not input_ids:
        raise ValidationError("`inputs` cannot be empty")
    return input_ids


def check_lengths(input_length: int, max_new_tokens: int | None, limits: TokenLimits) -> int:
    if max_new_tokens is None:
        max_new_tokens = max(min(DEFAULT_MAX_NEW_TOKENS, limits.max_total_tokens - input_length), 1)
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= "
                              f"{limits.max_total_tokens}. Given: {input_length} `inputs` tokens "
                              f"and {max_new_tokens} `max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} tokens. "
                              f"Given: {input_length}")
    return max_new_tokens
