"""OpenAI's legacy /v1/completions: one prompt or several, echo, suffix (fill-in-the-middle), logprobs."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from aiohttp import web

from router.api.openai import guided, vllm_fields
from router.api.openai.common import (FINGERPRINT, FINISH, OpenAIStream, adapter_as_model,
                                      openai_logprob, usage)
from router.api.openai.request import (build_request, choice_count, include_usage, model_name,
                                       sampling_and_stops, with_model_defaults)
from router.core.generation import GenerateResult
from router.errors import ValidationError, about_field
from router.http.json_body import read_object
from router.http.sse import openai_sse, serve_stream
from router.inputs.field_ranges import read_flag, read_number
from router.inputs.seeds import copies, seed_or_draw
from router.inputs.stop_text import StopHoldback, without_stop
from router.inputs.validation import chosen_adapter
from router.schemas import GenerateRequest, SamplingParams, TokenEvent
from router.state import model_and_adapter

# TGI's document's default for this route (OpenAI's is 16): on a route of TGI's document, TGI's
# default wins (docs/apis.md)
DEFAULT_MAX_TOKENS = 32
_FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def _prompts(body: dict, max_prompts: int) -> list[str]:
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValidationError("`prompt` must be a string or a non-empty list of strings")
    if len(prompts) > max_prompts:
        raise ValidationError(f"Number of prompts exceeds the maximum allowed batch size of "
                              f"{max_prompts}")
    return prompts


def _with_suffix(prompt: str, suffix: str | None, tokenizer) -> str:
    """Fill-in-the-middle when the tokenizer has its tokens; a clear 422 when it has not."""
    if not suffix:
        return prompt
    if any(tokenizer.tokenizer.token_to_id(t) is None for t in _FIM):
        raise ValidationError("`suffix` needs a model with fill-in-the-middle tokens "
                              f"({', '.join(_FIM)}); this one has none")
    return f"{_FIM[0]}{prompt}{_FIM[1]}{suffix}{_FIM[2]}"


def _own_seed(sampling: SamplingParams, body: dict) -> SamplingParams:
    """A prompt's copy of the body's sampling, with a seed of its own.

    The seed is a draw of its own where the body has no `seed`, so that the same prompt twice gives
    two samples, as two requests would."""
    return replace(sampling, seed=seed_or_draw(sampling.seed if body.get("seed") is not None
                                               else None))


async def _validate(served, body: dict, adapter_id: str | None):
    limits = served.validation_limits
    chosen_adapter(adapter_id, served.adapters)  # one being unloaded is refused from the start
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= limits.max_top_n_tokens):
        raise ValidationError(f"`logprobs` must be an integer >= 0 and <= "
                              f"{limits.max_top_n_tokens}. Given: {logprobs}")
    echo = read_flag(body, "echo")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise ValidationError("`suffix` must be a string")
    n = choice_count(body, served.config.max_client_batch_size)
    best_of = read_number(body, "best_of", 1, limits.max_best_of, integer=True)
    if best_of is not None and best_of < n:
        raise ValidationError(f"`best_of` must be >= `n`. Given: {best_of} < {n}")
    if best_of is not None and best_of > 1 and read_flag(body, "stream"):
        raise ValidationError("`best_of` cannot be used with `stream`: the best are known only "
                              "once every candidate has ended")
    candidates = best_of or n  # per prompt; the n most likely are answered
    # response_format as vLLM takes it here, or vLLM's own fields; compiling one may take a
    # while: off the event loop
    constraint = await asyncio.to_thread(guided.constraint, body)
    prompt_top_n = vllm_fields.prompt_logprobs(body, limits.max_top_n_tokens)
    # read once for every prompt, off the event loop (a logit_bias may be 100,000 entries)
    sampling, stop = await asyncio.to_thread(sampling_and_stops, body, limits)
    requests = []
    for text in _prompts(body, served.config.max_client_batch_size):
        prompt = _with_suffix(text, suffix, served.tokenizer)
        with about_field("prompt"):
            input_ids = await served.tokenizer.encode_async(
                prompt, max_tokens=limits.tokens.max_input_tokens)
        if not input_ids:
            raise ValidationError("`prompt` cannot be empty")
        default_max = served.request_defaults.get("token_limit", DEFAULT_MAX_TOKENS)
        base = build_request(prompt, input_ids, body, limits, default_max_tokens=default_max,
                             top_n_tokens=logprobs or 0, grammar_spec=constraint,
                             prefill_logprobs=echo and logprobs is not None,
                             parsed=(_own_seed(sampling, body), list(stop)),
                             adapter_id=adapter_id, prompt_field="prompt")
        requests += copies(vllm_fields.with_prompt_logprobs(base, prompt_top_n), candidates)
    return requests, echo, logprobs, n, candidates, prompt_top_n is not None


def _best(requests: list[GenerateRequest], results: list[GenerateResult], n: int,
          candidates: int) -> tuple[list[GenerateRequest], list[GenerateResult]]:
    """The n best of each prompt's candidates, most likely first.

    The n with the highest log-probability per token (OpenAI's rule for best_of)."""
    if candidates == n:
        return requests, results
    kept_requests, kept_results = [], []
    for start in range(0, len(results), candidates):
        group = list(zip(requests[start:start + candidates], results[start:start + candidates]))
        group.sort(key=lambda pair: pair[1].logprob_sum / max(1, len(pair[1].tokens)),
                   reverse=True)
        kept_requests += [r for r, _ in group[:n]]
        kept_results += [result for _, result in group[:n]]
    return kept_requests, kept_results


def _logprobs(result: GenerateResult, echo: bool, prompt_length: int) -> dict:
    """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = (result.prefill if echo else []) + result.tokens
    tops = ([{} for _ in result.prefill] if echo else []) + [
        {t.text: openai_logprob(t.logprob) for t in top} for top in result.top_tokens]
    offsets, position = [], 0 if echo else prompt_length
    for token in tokens:
        offsets.append(position)
        position += len(token.text)
    return {"tokens": [t.text for t in tokens],
            # a prompt's first token has no logprob (null, as OpenAI writes it)
            "token_logprobs": ([t.logprob for t in result.prefill] if echo else [])
            + [openai_logprob(t.logprob) for t in result.tokens],
            "top_logprobs": tops, "text_offset": offsets}


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    vllm_fields.UNKNOWN.check(body, vllm_fields.COMPLETION_FIELDS, "/v1/completions")
    served, adapter_id = model_and_adapter(request, model_name(body))
    body = with_model_defaults(body, served.request_defaults)
    with adapter_as_model():
        requests, echo, logprobs, n, candidates, prompt_logprobs = \
            await served.infer.count_request(_validate(served, body, adapter_id))
        # the adapter's name when `model` named one, as vLLM answers
        envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": adapter_id or served.model_name,
                    "system_fingerprint": FINGERPRINT}
        # each prompt once, however many choices it has (as OpenAI and vLLM count)
        prompt_tokens = sum(r.input_length for r in requests[::candidates])
        stream, with_usage = read_flag(body, "stream"), include_usage(body)
        running = vllm_fields.continuous_usage(body)
        if stream:
            form = CompletionStream(requests, envelope, echo=echo, prompt_tokens=prompt_tokens,
                                    with_usage=with_usage, running=running)
            return await serve_stream(request, served.infer.stream_many(requests), form,
                                      streams=len(requests))
        results = await served.infer.generate_many(requests)
    completion_tokens = sum(r.final.generated_tokens for r in results)  # every candidate's
    requests, results = _best(requests, results, n, candidates)
    choices = [{"index": i, "text": (r.inputs if echo else "") + without_stop(
                    result.final.text, result.final, r.stopping.stop_sequences),
                "finish_reason": FINISH[result.final.finish_reason],
                "logprobs": _logprobs(result, echo, len(r.inputs)) if logprobs is not None else None}
               for i, (r, result) in enumerate(zip(requests, results))]
    if prompt_logprobs:  # vLLM's, per choice: each choice's prompt
        for choice, result in zip(choices, results):
            choice["prompt_logprobs"] = vllm_fields.prompt_logprobs_entries(
                result.prefill, result.prefill_top_tokens)
    return web.json_response({**envelope, "choices": choices,
                              "usage": usage(prompt_tokens, completion_tokens)})


class CompletionStream(OpenAIStream):
    """text_completion chunks: the prompts first when echoed, one per token, then the usage."""

    def __init__(self, requests: list[GenerateRequest], envelope: dict, *, echo: bool,
                 prompt_tokens: int, with_usage: bool, running: bool = False):
        self.requests = requests
        self.envelope = envelope
        self.echo = echo
        self.prompt_tokens = prompt_tokens
        self.with_usage = with_usage
        self.completion_tokens = 0
        self.holdbacks = [StopHoldback(r.stopping.stop_sequences) for r in requests]
        self.running = vllm_fields.RunningUsage([r.input_length for r in requests], running)

    def _chunk(self, **fields) -> bytes:
        return openai_sse({**self.envelope, **fields})

    def opening(self) -> list[bytes]:
        if not self.echo:
            return []
        return [self._chunk(choices=[{"index": i, "text": r.inputs, "logprobs": None,
                                      "finish_reason": ""}])
                for i, r in enumerate(self.requests)]

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        if event.final is not None:
            self.completion_tokens += event.final.generated_tokens
        # "" until the end: TGI's Chunk schema has no null finish_reason
        finish = FINISH[event.final.finish_reason] if event.final else ""
        text = self.holdbacks[index].text(event.token.text, event.final)
        return [self._chunk(choices=[{"index": index, "text": text, "logprobs": None,
                                      "finish_reason": finish}],
                            **self.running.after(index, event))]

    def closing(self) -> list[bytes]:
        if not self.with_usage:
            return []
        return [self._chunk(choices=[], usage=usage(self.prompt_tokens, self.completion_tokens))]


def register(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
