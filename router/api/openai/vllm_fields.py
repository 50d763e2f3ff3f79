"""vLLM's prompt fields on the OpenAI routes, and the fields those routes do not know.

`prompt_logprobs`, `add_generation_prompt` and `continue_final_message` (chat), and
`stream_options.continuous_usage_stats`. A field neither route reads is ignored as vLLM ignores
it, with a warning logged once per field name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from router.api.openai.common import openai_logprob, usage
from router.api.openai.guided import GUIDED_FIELDS, OPTION_FIELDS
from router.errors import TemplateError, ValidationError
from router.inputs.field_ranges import read_flag, read_number
from router.inputs.unknown_fields import UnknownFields
from router.schemas import GenerateRequest, Token, TokenEvent

_STRUCTURED = {*GUIDED_FIELDS, *OPTION_FIELDS, "structured_outputs"}
# what both routes read: OpenAI's fields, TGI's, vLLM's extensions (`user` has no effect on an
# answer anywhere: OpenAI's, vLLM's and TGI's servers take it and keep it out of generation)
_SHARED = {"model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens",
           "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options",
           "temperature", "top_p", "response_format", "user", "top_k", "repetition_penalty",
           "ignore_eos", "min_tokens", "min_p", "stop_token_ids", "prompt_logprobs", *_STRUCTURED}
CHAT_FIELDS = frozenset({*_SHARED, "messages", "top_logprobs", "tools", "tool_choice",
                         "tool_prompt", "parallel_tool_calls", "chat_template_kwargs",
                         "add_generation_prompt", "continue_final_message"})
COMPLETION_FIELDS = frozenset({*_SHARED, "prompt", "echo", "suffix", "best_of"})


UNKNOWN = UnknownFields("as vLLM ignores fields it does not know")


def prompt_logprobs(body: dict, max_top_n_tokens: int) -> int | None:
    """vLLM's `prompt_logprobs`: how many alternatives each prompt position lists, or None."""
    if body.get("prompt_logprobs") == -1:
        raise ValidationError("`prompt_logprobs` -1 (the whole vocabulary) is not served: at "
                              f"most {max_top_n_tokens} alternatives a position "
                              "(--max-top-n-tokens)")
    top_n = read_number(body, "prompt_logprobs", 0, max_top_n_tokens, integer=True)
    if top_n is not None and read_flag(body, "stream"):
        raise ValidationError("`prompt_logprobs` are not available when `stream=True`.")
    return top_n


def with_prompt_logprobs(request: GenerateRequest, top_n: int | None) -> GenerateRequest:
    """`request` asking the shards for its prompt's logprobs (and `top_n` alternatives)."""
    if top_n is None:
        return request
    return replace(request, prefill_logprobs=True, prefill_top_n_tokens=top_n)


def _logprob(token: Token, rank: int | None) -> dict:
    return {"logprob": openai_logprob(token.logprob), "rank": rank, "decoded_token": token.text}


def prompt_logprobs_entries(prefill: list[Token], tops: list[list[Token]] | None
                            ) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: logprob} a position.

    Each position's own token, with its rank when it is among the alternatives (vLLM always
    knows it; the shards rank the top ones only, so it is null past them), then the alternatives
    ranked from 1."""
    entries: list[dict | None] = [None]
    for position, token in enumerate(prefill[1:], 1):
        top = tops[position] if tops and position < len(tops) else []
        ranks = {}
        for rank, alternative in enumerate(top, 1):
            ranks.setdefault(alternative.id, rank)
        entry = {str(token.id): _logprob(token, ranks.get(token.id))}
        for alternative in top:
            entry.setdefault(str(alternative.id), _logprob(alternative, ranks[alternative.id]))
        entries.append(entry)
    return entries


@dataclass(frozen=True, slots=True)
class GenerationPrompt:
    """How a chat's prompt ends.

    With the assistant's header (`add_generation_prompt`), or with the final message left open
    (`continue_final`, its text)."""

    add_generation_prompt: bool = True
    continue_final: str | None = None


def generation_prompt(body: dict, messages: list[dict]) -> GenerationPrompt:
    """vLLM's `add_generation_prompt` (true unless continuing) and `continue_final_message`."""
    continuing = read_flag(body, "continue_final_message")
    add = read_flag(body, "add_generation_prompt", not continuing)
    if continuing and add:
        raise ValidationError("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.", param="continue_final_message")
    final = messages[-1]["content"]
    if isinstance(final, list):  # its text and images: the text the prompt ends in
        final = "".join(p.get("text", "") for p in final if p.get("type") == "text")
    return GenerationPrompt(add, final if continuing else None)


def continued(prompt: str, final: str | None) -> str:
    """The rendered prompt cut after the final message's text, as transformers cuts it.

    What a template writes after the message (its end-of-turn token) goes, so that the model
    continues the message; a template that trims the message's trailing space is cut after the
    trimmed text."""
    if final is None:
        return prompt
    if final.strip() not in prompt:
        raise TemplateError("continue_final_message is set but the final message does not appear "
                            "in the prompt the chat template renders (the template changes it)")
    start = prompt.rindex(final.strip())
    if prompt[start:start + len(final.lstrip())] == final:
        return prompt[:start + len(final.lstrip())]
    return prompt[:start + len(final.strip())]


def continuous_usage(body: dict) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: a running usage in every chunk."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return False  # include_usage refuses what is not an object
    asked = read_flag(options, "continuous_usage_stats",
                      path="stream_options.continuous_usage_stats")
    if asked and not read_flag(body, "stream"):
        raise ValidationError("`stream_options.continuous_usage_stats` needs `stream: true`: it "
                              "puts the usage so far in every streamed chunk")
    return asked


class RunningUsage:
    """The usage so far of each stream of a streamed answer (each choice its own)."""

    def __init__(self, prompt_tokens: list[int], enabled: bool):
        self.prompt_tokens = prompt_tokens
        self.enabled = enabled
        self.generated = [0] * len(prompt_tokens)

    def after(self, index: int, event: TokenEvent) -> dict:
        """The chunk fields for stream `index` once `event` is counted: {"usage": ...} or none."""
        if not self.enabled:
            return {}
        self.generated[index] = (event.final.generated_tokens if event.final is not None
                                 else self.generated[index] + 1)
        return {"usage": usage(self.prompt_tokens[index], self.generated[index])}
