"""SGLang's native /generate body (GenerateReqInput) -> validated GenerateRequests and options.

SGLang's defaults differ from TGI's: temperature 1.0 samples and 0 is greedy, top_k -1 is off,
max_new_tokens is 128, and a stop string is trimmed from the text unless `no_stop_trim`. Every
number goes through router.inputs.field_ranges's ranges as on the other APIs. A field of SGLang's
this server cannot honour is refused, saying why, never silently dropped. A top-level field SGLang
does not know is ignored as SGLang ignores it (its GenerateReqInput is a dataclass FastAPI fills,
dropping extra keys; newer clients send newer fields), with a warning logged once per name. Every
refusal is a 400 on this route, as SGLang answers (router/api/sglang/routes.py).

`max_new_tokens: 0` scores the prompt: the request runs its prefill (whose log-probabilities
`return_logprob` with `logprob_start_len` >= 0 returns) and the answer has no output tokens; the
token the prefill samples anyway is left out of it (router/api/sglang/run.py).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

import numpy

from router.api.sglang.images import check_modalities, prompt_images, text_with_images
from router.api.sglang.lora import LoadedAdapters, prompt_adapters
from router.api.sglang.sampling import DEFAULT_MAX_NEW_TOKENS, SglangSampling, parse_sampling
from router.errors import ValidationError
from router.inputs.field_ranges import INT32, UINT32, check_int, checked_token_ids, read_flag
from router.inputs.images.family import ImageFamily
from router.inputs.images.placement import placed, text_only_refusal
from router.inputs.images.sources import MediaLimits
from router.inputs.seeds import copies, draw_seed
from router.inputs.unknown_fields import UnknownFields
from router.inputs.tokenizer import RouterTokenizer
from router.inputs.validation import ValidationLimits, check_lengths
from router.schemas import GenerateRequest, StoppingParams


INPUT_FIELDS = ("text", "input_ids", "input_embeds")

MAX_LOGPROB_TOKEN_IDS = 1024  # ids per position in token_ids_logprob: bounds the answer's size

# top-level fields that need work elsewhere first (the shards): refused, with the reason
_NOT_YET = {
    "custom_logit_processor": "`custom_logit_processor` is refused: it is serialized Python from "
                              "the client, which this server never runs",
    "session_params": "`session_params` is refused: SGLang's sessions (/open_session) keep each "
                      "turn's tokens and append the next prompt to them; this server keeps no "
                      "such session on this route (its request_id sessions of "
                      "/api/generate-one continue from the generated text and take no new "
                      "prompt). Send the whole conversation as `text`: the prefix cache reuses "
                      "the blocks of the turns before",
    "bootstrap_host": "disaggregated serving (`bootstrap_*`) is not supported",
    "bootstrap_port": "disaggregated serving (`bootstrap_*`) is not supported",
    "bootstrap_room": "disaggregated serving (`bootstrap_*`) is not supported",
    "data_parallel_rank": "`data_parallel_rank` is not supported: this server has one data "
                          "parallel rank",
}
_TEXT_ONLY = ("image_data", "audio_data", "video_data", "modalities")
_IMAGE_FIELDS = ("image_data", "modalities")  # taken by a model that takes images
# SGLang's fields (not in its document) asking for more in the answer than this server computes:
# refused when true, so that no client reads an answer without what it asked for
_MORE_OUTPUT = ("return_prompt_token_ids", "return_entropy", "return_routed_experts",
                "return_sampling_mask", "return_flat_raw_top_logprobs",
                "return_flat_raw_top_logprobs_b64", "return_bytes", "require_reasoning")
_TOP_LEVEL = {*INPUT_FIELDS, *_NOT_YET, *_TEXT_ONLY, *_MORE_OUTPUT, "sampling_params", "rid",
              "stream",
              "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
              "return_text_in_logprobs", "return_hidden_states", "lora_path", "lora_id"}

@dataclass(slots=True)
class LogprobOptions:
    enabled: bool = False
    start_len: int = -1  # prompt position where input logprobs start; -1: output only
    top_n: int = 0
    with_text: bool = False
    token_ids: list[int] = field(default_factory=list)  # token_ids_logprob
    token_texts: list[str | None] = field(default_factory=list)  # their text, when with_text


@dataclass(slots=True)
class SglangItem:
    """One generation (one of a prompt's n)."""

    request: GenerateRequest
    rid: str
    logprobs: LogprobOptions
    no_stop_trim: bool
    return_hidden_states: bool = False
    score_only: bool = False  # max_new_tokens 0: the prompt's prefill, no output tokens
    stream_interval: int = 1  # a streamed frame every this many tokens (and the last)


@dataclass(slots=True)
class SglangBatch:
    items: list[SglangItem]  # batch-major: every copy of prompt 0, then of prompt 1...
    is_batch: bool  # a list of prompts (the answer is a list even with one)
    stream: bool

    @property
    def as_list(self) -> bool:
        return self.is_batch or len(self.items) > 1


def is_sglang_body(body: dict) -> bool:
    """Whether a /generate body is SGLang's: one of its input fields and no TGI `inputs`."""
    return "inputs" not in body and any(name in body for name in INPUT_FIELDS)


def _per_item(body: dict, name: str, count: int) -> list:
    """A top-level option given once, or once per prompt as a list."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise ValidationError(f"`{name}` holds {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count


def _prompts(body: dict) -> tuple[list, bool, str]:
    """(prompts, is a batch, field): strings for `text`, lists of ids for `input_ids`."""
    given = [name for name in INPUT_FIELDS if body.get(name) is not None]
    if len(given) != 1:
        raise ValidationError("exactly one of `text`, `input_ids` or `input_embeds` must be given"
                              + (f" (got {', '.join(given)})" if given else ""))
    name = given[0]
    value = body[name]
    if name == "input_embeds":
        if isinstance(value, list) and value:
            first = value[0]  # a batch is a list of prompts, each a list of vectors
            if isinstance(first, list) and first and isinstance(first[0], list):
                return value, True, name
            return [value], False, name
        raise ValidationError("`input_embeds` must be a non-empty list of vectors (one prompt) "
                              "or a list of such lists (a batch)")
    if name == "text":
        if isinstance(value, str):
            return [value], False, name
        if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            return value, True, name
        raise ValidationError("`text` must be a string or a non-empty list of strings")
    if isinstance(value, list) and value and all(isinstance(i, list) for i in value):
        return value, True, name
    if isinstance(value, list) and value:
        return [value], False, name
    raise ValidationError("`input_ids` must be a non-empty list of token ids or a non-empty list "
                          "of such lists")


def _logprob_options(body: dict, index: int, count: int, limits: ValidationLimits,
                     prompt_length: int, vocab_size: int, decode) -> LogprobOptions:
    enabled = _per_item(body, "return_logprob", count)[index]
    start = _per_item(body, "logprob_start_len", count)[index]
    top_n = _per_item(body, "top_logprobs_num", count)[index]
    if enabled is not None and not isinstance(enabled, bool):
        raise ValidationError("`return_logprob` must be a boolean or a list of booleans")
    start = -1 if start is None else check_int("logprob_start_len", start, INT32)
    top_n = 0 if top_n is None else check_int("top_logprobs_num", top_n, UINT32)
    if top_n > limits.max_top_n_tokens:
        raise ValidationError(f"`top_logprobs_num` must be >= 0 and <= {limits.max_top_n_tokens}. "
                              f"Given: {top_n}")
    if start < -1 or start >= prompt_length:
        raise ValidationError(f"`logprob_start_len` ({start}) must be -1 or a position in the "
                              f"prompt (0 to {prompt_length - 1})")
    with_text = read_flag(body, "return_text_in_logprobs", False, path="return_text_in_logprobs")
    token_ids = _logprob_token_ids(body, index, count, vocab_size)
    if token_ids and not enabled:
        raise ValidationError("`token_ids_logprob` needs `return_logprob`: true")
    texts = [decode([t]) if with_text else None for t in token_ids]
    return LogprobOptions(bool(enabled), start, top_n, with_text, token_ids, texts)


def _logprob_token_ids(body: dict, index: int, count: int, vocab_size: int) -> list[int]:
    """token_ids_logprob: one list for every prompt, or (for a batch) one list per prompt."""
    value = body.get("token_ids_logprob")
    if value is None:
        return []
    path = "token_ids_logprob"
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) != count:
            raise ValidationError(f"`token_ids_logprob` holds {len(value)} lists for {count} "
                                  "prompts")
        value, path = value[index], f"token_ids_logprob[{index}]"
    if not isinstance(value, list):
        raise ValidationError("`token_ids_logprob` must be a list of token ids (or one list per "
                              "prompt)")
    if len(value) > MAX_LOGPROB_TOKEN_IDS:
        raise ValidationError(f"`{path}` names {len(value)} ids; at most "
                              f"{MAX_LOGPROB_TOKEN_IDS} are allowed")
    return checked_token_ids(value, path, vocab_size)


def _embeds(prompt, path: str, hidden_size: int) -> tuple[bytes, int]:
    """One prompt's vectors -> (float32 bytes, rows), each row checked: hidden_size finite numbers."""
    if not isinstance(prompt, list) or not prompt:
        raise ValidationError(f"`{path}` must be a non-empty list of vectors")
    for i, row in enumerate(prompt):
        if not isinstance(row, list) or len(row) != hidden_size:
            raise ValidationError(f"`{path}[{i}]` must be a list of {hidden_size} numbers (the "
                                  f"model's hidden size)")
        for value in row:
            # compared, not converted: an integer past a float (10**400) overflows float()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not abs(value) <= 3.4e38:  # NaN too
                raise ValidationError(f"`{path}[{i}]` must hold finite numbers (float32)")
    return numpy.asarray(prompt, dtype="<f4").tobytes(), len(prompt)


UNKNOWN = UnknownFields("as SGLang ignores it")  # top-level fields SGLang's request lacks


def check_fields(body: dict, *, takes_images: bool = False) -> None:
    for name, value in body.items():
        if name not in _TOP_LEVEL:
            UNKNOWN.note(name, "SGLang /generate")
            continue
        if value is None:
            continue
        if takes_images and name in _IMAGE_FIELDS:
            continue  # router.api.sglang.images reads them
        if name in _TEXT_ONLY:
            raise ValidationError(f"`{name}` is not supported: this model reads text only")
        if name in _NOT_YET:
            raise ValidationError(_NOT_YET[name])
        if name in _MORE_OUTPUT and value is not False:
            raise ValidationError(f"`{name}` is not supported: this server does not compute "
                                  "what it asks for")


def _rids(body: dict, count: int) -> list[str]:
    rids = _per_item(body, "rid", count)
    out = []
    for rid in rids:
        if rid is None:
            rid = uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValidationError("`rid` must be a non-empty string (or, for a batch, a list of "
                                  "them)")
        out.append(rid)
    if len(set(out)) != len(out):
        raise ValidationError("`rid` names two prompts of the batch alike")
    return out


async def parse_generate(body: dict, tokenizer: RouterTokenizer, limits: ValidationLimits,
                         max_batch: int, hidden_size: int, *,
                         adapters: LoadedAdapters | None = None,
                         images: ImageFamily | None = None, media: MediaLimits = MediaLimits(),
                         model: str = "this model") -> SglangBatch:
    """The whole body -> one GenerateRequest per prompt and copy, in batch-major order.

    `hidden_size` is the width of a row of `input_embeds`; `adapters`: the model's LoRA adapters,
    which `lora_path` / `lora_id` choose from; `images`: the model's image family (None: it reads
    text only), `image_data` read within `media`."""
    if images is None and body.get("image_data") is not None:
        raise text_only_refusal(model)
    check_fields(body, takes_images=images is not None)
    if images is not None:
        check_modalities(body)
    prompts, batch, field_name = _prompts(body)
    if len(prompts) > max_batch:
        raise ValidationError(f"Number of prompts exceeds the maximum allowed batch size of "
                              f"{max_batch}")
    stream = read_flag(body, "stream", False, path="stream")
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise ValidationError(f"`sampling_params` holds {len(params)} objects for "
                                  f"{len(prompts)} prompts")
    adapter_ids = prompt_adapters(body, len(prompts), adapters)
    vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)

    def parse_all() -> list[SglangSampling]:
        if isinstance(params, list):
            return [parse_sampling(p, limits, max_batch, vocab_size) for p in params]
        # parsed (and its grammar compiled) once for every prompt
        return [parse_sampling(params, limits, max_batch, vocab_size)] * len(prompts)

    # compiling the grammars may take a while: off the event loop
    parsed = await asyncio.to_thread(parse_all)
    rids = _rids(body, len(prompts))
    loaded = await prompt_images(body, len(prompts), batch, field_name, images, media, model)
    items = []
    for index, prompt in enumerate(prompts):
        asked = parsed[index]
        if not asked.seeded:  # each prompt samples with its own seed, as when parsed apart
            asked = replace(asked, sampling=replace(asked.sampling, seed=draw_seed()))
        embeds, rows = None, 0
        if field_name == "text":
            if not prompt and not loaded[index]:  # images alone are a prompt
                raise ValidationError("`text` cannot be empty")
            text, input_ids = prompt, await tokenizer.encode_async(
                text_with_images(prompt, images, loaded[index]) if loaded[index]
                else prompt, max_tokens=limits.tokens.max_input_tokens)
        elif field_name == "input_embeds":
            path = f"input_embeds[{index}]" if batch else "input_embeds"
            embeds, rows = _embeds(prompt, path, hidden_size)
            text, input_ids = "", []
        else:
            path = f"input_ids[{index}]" if batch else "input_ids"
            if not isinstance(prompt, list) or not prompt:
                raise ValidationError(f"`{path}` must be a non-empty list of token ids")
            input_ids = checked_token_ids(prompt, path, vocab_size)
            text = None  # decoded once the length is known to be within the limits
        if not input_ids and embeds is None:
            raise ValidationError("`text` cannot be empty")
        length = rows if embeds is not None else len(input_ids)
        max_new_tokens = asked.max_new_tokens
        score_only = max_new_tokens == 0
        if score_only:  # the prefill samples one token all the same: room for it
            max_new_tokens = 1
        if max_new_tokens is None:  # the default, not the client's number: fit it to the room left
            max_new_tokens = max(min(DEFAULT_MAX_NEW_TOKENS,
                                     limits.tokens.max_total_tokens - length), 1)
        max_new_tokens = check_lengths(length, max_new_tokens, limits.tokens)
        if text is None:
            text = tokenizer.tokenizer.decode(input_ids, skip_special_tokens=False)
        logprobs = _logprob_options(body, index, len(prompts), limits, length, vocab_size,
                                    tokenizer.tokenizer.decode)
        if embeds is not None and logprobs.enabled and logprobs.start_len >= 0:
            raise ValidationError("a prompt given as `input_embeds` has no token ids to score: "
                                  "use `logprob_start_len` -1")
        hidden = _per_item(body, "return_hidden_states", len(prompts))[index]
        if hidden is not None and not isinstance(hidden, bool):
            raise ValidationError("`return_hidden_states` must be a boolean or a list of booleans")
        base = GenerateRequest(
            inputs=text, input_ids=input_ids, sampling=asked.sampling,
            stopping=StoppingParams(max_new_tokens=max_new_tokens,
                                    stop_sequences=[] if score_only else asked.stop,
                                    ignore_eos=asked.ignore_eos,
                                    min_new_tokens=asked.min_new_tokens,
                                    stop_token_ids=[] if score_only else asked.stop_token_ids),
            top_n_tokens=logprobs.top_n if logprobs.enabled else 0,
            prefill_logprobs=logprobs.enabled and logprobs.start_len >= 0,
            skip_special_tokens=asked.skip_special_tokens, grammar=asked.grammar,
            input_embeds=embeds, embeds_rows=rows, logprob_token_ids=logprobs.token_ids,
            prefill_top_n_tokens=logprobs.top_n if logprobs.enabled and logprobs.start_len >= 0
            else 0, return_hidden_states=bool(hidden), adapter_id=adapter_ids[index],
            images=placed(input_ids, images, loaded[index]) if loaded[index] else [])
        for request in copies(base, asked.n):
            items.append(SglangItem(request, rids[index], logprobs, asked.no_stop_trim,
                                    bool(hidden), score_only, asked.stream_interval))
    return SglangBatch(items, batch, stream)
