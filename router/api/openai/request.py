"""OpenAI request bodies (chat and legacy completions) -> validated GenerateRequests and options."""
from __future__ import annotations

import json
from dataclasses import dataclass

from router.api.openai.chat_images import content_parts
from router.inputs.tool_plan import ToolPlan, with_tool_prompt
from router.api.openai.vllm_fields import GenerationPrompt
from router.errors import TemplateError, ValidationError, about_field
from router.inputs import json_text
from router.inputs.chat_template import ChatTemplate
from router.inputs.field_ranges import (FLOAT32_MAX, check_logit_bias, checked_token_ids, read_flag,
                                        read_number)
from router.inputs.images.family import ImageFamily
from router.inputs.seeds import seed_or_draw
from router.inputs.stop_text import stop_strings
from router.inputs.template_worker import encode_job
from router.inputs.validation import ValidationLimits, check_lengths
from router.lifecycle.settings import ChatPrompt
from router.schemas import GenerateRequest, PromptImage, SamplingParams, StoppingParams

_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(slots=True)
class ChatOptions:
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # vLLM's, in the answer
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ValidationError("`stream_options` must be an object")
    return read_flag(options, "include_usage")


def sampling_and_stops(body: dict, limits: ValidationLimits) -> tuple[SamplingParams, list[str]]:
    """OpenAI's sampling fields: temperature 0 is greedy, penalties are additive, top_p 1 is off."""
    temperature = read_number(body, "temperature", 0, 2)
    top_p = read_number(body, "top_p", 0, 1, low_open=True)
    seed = read_number(body, "seed", 0, 2**64 - 1, integer=True)
    top_k = read_number(body, "top_k", -1, 2**31 - 1, integer=True)  # vLLM's extension: -1 or 0 off
    sampling = SamplingParams(
        temperature=temperature or 1.0, top_p=top_p or 1.0, top_k=max(top_k or 0, 0),
        frequency_penalty=read_number(body, "frequency_penalty", -2, 2) or 0.0,
        presence_penalty=read_number(body, "presence_penalty", -2, 2) or 0.0,
        # vLLM's extension (TGI's multiplicative penalty): > 0, 1 is off
        repetition_penalty=read_number(body, "repetition_penalty", 0, FLOAT32_MAX,
                                  low_open=True) or 1.0,
        min_p=read_number(body, "min_p", 0, 1) or 0.0,  # vLLM's extension, as SGLang's
        do_sample=temperature != 0,  # OpenAI samples unless the temperature is 0
        seed=seed_or_draw(seed),
        logit_bias=check_logit_bias("logit_bias", body.get("logit_bias"), limits.vocab_size,
                                    listed=True))
    return sampling, stop_strings(body.get("stop"), "`stop`", limits.max_stop_sequences)


def model_name(body: dict) -> str | None:
    """The model a body names.

    A served model's id or a loaded LoRA adapter's name (router/state.model_and_adapter finds
    it)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValidationError("`model` must be a string")
    return model


# Jan's per-model parameters (PATCH /v1/models/{id}) and the OpenAI fields they give defaults to;
# `token_limit` is a default max_tokens (default_max_tokens), trimmed to the room the prompt leaves
_MODEL_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "stream": "stream", "stop": "stop", "frequency_penalty": "frequency_penalty",
                   "presence_penalty": "presence_penalty"}


def with_model_defaults(body: dict, defaults: dict) -> dict:
    """`body` with the model's request defaults for the fields it leaves out (or null)."""
    if not defaults:
        return body
    out = dict(body)
    for key, name in _MODEL_DEFAULTS.items():
        if key in defaults and out.get(name) is None:
            out[name] = defaults[key]
    return out


def choice_count(body: dict, max_choices: int) -> int:
    n = read_number(body, "n", 1, max_choices, integer=True)
    return n or 1


def _message_text(message: dict, index: int, images: ImageFamily | None,
                  model: str) -> str | list[dict]:
    content = message.get("content")
    calls = message.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function", c), dict) for c in calls)):
        raise ValidationError(f"messages[{index}].tool_calls must be a list of "
                              "{\"type\": \"function\", \"function\": {\"name\": ..., "
                              "\"arguments\": ...}} objects")
    if content is None:
        return ""  # an assistant turn that called tools: see _calls_as_text
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return content_parts(content, index, images, model)
    raise ValidationError(f"messages[{index}].content must be a string or a list of parts")


def _calls_as_text(message: dict) -> dict:
    """An assistant turn's tool calls as its text, for a prompt that cannot show them.

    For a turn that called tools and said nothing, and a prompt that cannot show `tool_calls` (a
    template that never reads them, Jan's prompt pieces). Templates that read them (Qwen3's, Llama
    3.1's...) get the turn as it came, as vLLM and transformers pass it, and would otherwise show
    the calls twice."""
    calls = message.get("tool_calls")
    if message["content"] or not calls:
        return message
    return {**message, "content": json.dumps([c.get("function", c) for c in calls],
                                             ensure_ascii=False)}


def normalise_messages(messages, *, images: ImageFamily | None = None,
                       model: str = "this model") -> list[dict]:
    """The messages as the template gets them: `images`, the model's image family, or None.

    A message's content is its text, or for a model that takes images and a message that holds
    some, its text and image parts (router.api.openai.chat_images).
    """
    if not isinstance(messages, list) or not messages:
        raise ValidationError("`messages` must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise ValidationError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({**message, "role": role, "content": _message_text(message, i, images, model)})
        if message.get("tool_calls"):
            out[-1]["tool_calls"] = [_with_arguments_object(c) for c in message["tool_calls"]]
    return out


def _with_arguments_object(call: dict) -> dict:
    """A call whose arguments, JSON text in OpenAI's requests, are the object they write.

    As vLLM gives them to templates: Llama 3.1's writes `arguments | tojson`, which would quote
    the text again; Qwen's writes either."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json_text.loads(function["arguments"])
    except json_text.JSONError:
        return call  # not JSON: the template gets the text as it came
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# what the router gives the template itself (messages, tools, add_generation_prompt) and what
# vLLM refuses (chat_template, tokenize: the model's template is the one rendered); a request's
# chat_template_kwargs naming one is a 422, not a value quietly replaced or ignored
_TEMPLATE_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                           "chat_template", "tokenize")


def chat_template_kwargs(body: dict) -> dict:
    """vLLM's and SGLang's `chat_template_kwargs`, checked.

    More variables for the chat template (Qwen3's `enable_thinking`, ...); as in transformers they
    may replace the special tokens (bos_token)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValidationError("`chat_template_kwargs` must be an object of template variables")
    for key in kwargs:
        if key in _TEMPLATE_OWN_VARIABLES:
            raise ValidationError(
                f"`chat_template_kwargs` cannot set {key!r}: the request's messages, tools and "
                "add_generation_prompt are the router's to give the template, and it renders the "
                "model's own template")
    documents = kwargs.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(
            isinstance(d, dict) for d in documents)):  # what apply_chat_template refuses
        raise ValidationError("`chat_template_kwargs.documents` must be a list of objects "
                              "({\"title\": ..., \"text\": ...})")
    return kwargs


@dataclass(slots=True)
class ChatPromptParts:
    """What a chat's prompt is made from: its text already, or a job for the template pool."""

    text: str | None = None  # Jan's prompt pieces, for a model without a template
    job: bytes | None = None  # the template's variables (router.inputs.template_worker)
    continue_final: str | None = None  # the final message's text, where the prompt is cut


def template_messages(template: ChatTemplate | None, messages: list[dict],
                      plan: ToolPlan | None = None) -> list[dict]:
    """The messages as the prompt shows them.

    With TGI's tool prompt (and the tools, where the template cannot show them) at the end of the
    last one, and calls as text where the template cannot show calls."""
    if plan is not None:
        shows_tools = template is not None and template.knows_tools
        messages = with_tool_prompt(messages, plan, template_shows_tools=shows_tools)
    if template is None or "tool_calls" not in template.source:
        messages = [_calls_as_text(m) for m in messages]
    return messages


def chat_prompt_parts(template: ChatTemplate | None, messages: list[dict],
                      plan: ToolPlan | None = None, *, fallback: ChatPrompt | None = None,
                      template_kwargs: dict | None = None,
                      ending: GenerationPrompt = GenerationPrompt()) -> ChatPromptParts:
    """What the prompt of a chat is made from.

    The model's template's job, else Jan's prompt pieces (`fallback`, which has no variables for
    `template_kwargs`) rendered; `ending`: vLLM's add_generation_prompt and
    continue_final_message."""
    if template is None and fallback is None:
        raise TemplateError("this model has no chat template")
    messages = template_messages(template, messages, plan)
    if template is None:
        return ChatPromptParts(text=fallback.render(
            messages, add_generation_prompt=ending.add_generation_prompt),
            continue_final=ending.continue_final)
    if template.template is None:
        raise TemplateError(template.error)
    # the tools as the request gives them (and transformers' get_json_schema makes them): what
    # templates that list tools print
    functions = plan.functions if plan is not None else None
    tools = [{"type": "function", "function": f} for f in functions] if functions else None
    variables = template.variables(messages, add_generation_prompt=ending.add_generation_prompt,
                                   tools=tools, extra=template_kwargs)
    return ChatPromptParts(job=encode_job(template.source, variables),
                           continue_final=ending.continue_final)


def build_request(prompt: str, input_ids: list[int], body: dict, limits: ValidationLimits, *,
                  default_max_tokens: int | None, top_n_tokens: int = 0,
                  grammar_spec: tuple[str, str] | None = None,
                  prefill_logprobs: bool = False,
                  parsed: tuple[SamplingParams, list[str]],
                  adapter_id: str | None = None, prompt_field: str,
                  skip_special_tokens: bool = True,
                  images: list[PromptImage] | None = None) -> GenerateRequest:
    """A chat body -> its validated GenerateRequest.

    `parsed`: sampling_and_stops(body, limits), which the caller reads off the event loop
    (a logit_bias may be 100,000 entries); `adapter_id`: the LoRA adapter `model` named;
    `prompt_field`: the body's field the prompt comes from (an error's `param`)."""
    sampling, stop = parsed
    asked = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
             else "max_tokens")
    max_tokens = read_number(body, asked, 1, 2**31 - 1, integer=True)
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = min(default_max_tokens, limits.tokens.max_total_tokens - len(input_ids))
    elif max_tokens is None:
        max_tokens = limits.tokens.max_total_tokens - len(input_ids)
    # OpenAI's name for what check_lengths refuses in TGI's words: the prompt, or the length asked
    too_long = prompt_field if len(input_ids) > limits.tokens.max_input_tokens else asked
    with about_field(too_long):
        max_tokens = check_lengths(len(input_ids), max(max_tokens, 1), limits.tokens)
    # vLLM's extensions, which load generators send to every OpenAI-compatible server
    min_tokens = read_number(body, "min_tokens", 0, 2**31 - 1, integer=True) or 0
    if min_tokens > max_tokens:
        raise ValidationError(f"`min_tokens` must be <= `max_tokens`. Given: {min_tokens} > "
                              f"{max_tokens}")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise ValidationError("`stop_token_ids` must be a list of token ids")
    stopping = StoppingParams(max_new_tokens=max_tokens, stop_sequences=stop,
                              ignore_eos=read_flag(body, "ignore_eos"), min_new_tokens=min_tokens,
                              stop_token_ids=checked_token_ids(stop_ids or [], "stop_token_ids",
                                                               limits.vocab_size))
    return GenerateRequest(inputs=prompt, input_ids=input_ids, sampling=sampling,
                           stopping=stopping,
                           top_n_tokens=top_n_tokens, prefill_logprobs=prefill_logprobs,
                           grammar=grammar_spec, adapter_id=adapter_id,
                           skip_special_tokens=skip_special_tokens, images=images or [])
