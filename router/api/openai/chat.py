"""OpenAI's chat route, /v1/chat/completions, in OpenAI's (and TGI's) shapes (/v1/models: api/models)."""
from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from router.api.openai import guided, vllm_fields
from router.api.openai.chat_images import image_sources, with_markers
from router.api.openai.common import (FINGERPRINT, FINISH, OpenAIStream, adapter_as_model,
                                      openai_logprob, usage)
from router.api.openai.request import (ChatOptions, ChatPromptParts, build_request,
                                       chat_prompt_parts, chat_template_kwargs, choice_count,
                                       include_usage, model_name, normalise_messages,
                                       sampling_and_stops, with_model_defaults)
from router.inputs.tool_answer import CallReading
from router.inputs.tool_plan import ToolPlan, tool_plan
from router.api.tgi.routes import tokens_response
from router.core.generation import GenerateResult
from router.errors import ValidationError, about_field
from router.http.json_body import read_object
from router.http.sse import openai_sse, serve_stream
from router.inputs.field_ranges import read_flag, read_number
from router.inputs.images.placement import expanded, placed
from router.inputs.images.sources import LoadedImage, load_images
from router.inputs.reasoning import ThinkSplitter, split_reasoning, starts_in_reasoning
from router.inputs.seeds import copies
from router.inputs.stop_text import StopHoldback, without_stop
from router.inputs.template_pool import TemplatePool
from router.inputs.validation import chosen_adapter
from router.schemas import FinalInfo, FinishReason, GenerateRequest, Token, TokenEvent
from router.state import STATE, model_and_adapter


def _token_logprob(token: Token) -> dict:
    return {"token": token.text, "logprob": openai_logprob(token.logprob),
            "bytes": list(token.text.encode("utf-8"))}


def _chat_logprobs(result: GenerateResult) -> dict:
    return {"content": [{**_token_logprob(t), "top_logprobs": [_token_logprob(a) for a in top]}
                        for t, top in zip(result.tokens, result.top_tokens)]}


def _message(result: GenerateResult, plan: ToolPlan, stops: list[str],
             reasoning: bool | None = None) -> tuple[dict, str]:
    """A choice's message object, and its finish reason.

    `reasoning`: None without --reasoning-parser, else whether the output begins inside the
    thinking block (router.inputs.reasoning); the calls are read from the answer after it."""
    finish = FINISH[result.final.finish_reason]
    text = without_stop(result.final.text, result.final, stops)
    if result.tokens:
        eos = _eos_text(result.tokens[-1], result.final)
        text = text[:len(text) - len(eos)] if eos and text.endswith(eos) else text
    thought = None
    if reasoning is not None:
        thought, text = split_reasoning(text, reasoning)
    reader = plan.reader()
    if reader is None:
        message = {"role": "assistant", "content": text}
    else:
        reading = CallReading(reader, plan.parallel, plan.new_call_id)
        reading.feed(text or "", last=True)
        message, finish = reading.message(), reading.finish_reason(finish)
    if reasoning is not None:
        message["reasoning_content"] = thought
    return message, finish


def _eos_text(token: Token, final: FinalInfo | None) -> str:
    """The text of the special token that ended the output, else "".

    Decoded only when the output keeps its special tokens for a tool parser (Mistral's
    [TOOL_CALLS]); never the answer's, as vLLM leaves it out."""
    if final is not None and final.finish_reason is FinishReason.EOS_TOKEN and token.special:
        return token.text
    return ""


class _Chat:
    """One chat request, validated: what to generate and how to answer.

    `reasoning`: None when the output is not split (no --reasoning-parser, or a grammar shapes all
    of it: tools and response_format leave no room to think), else whether it begins inside the
    thinking block. `model`: the name the answer gives, the LoRA adapter's when `model` named one
    (vLLM's)."""

    def __init__(self, request: GenerateRequest, options: ChatOptions, plan: ToolPlan,
                 reasoning: bool | None = None, *, model: str):
        self.request = request
        self.model = model
        self.options = options
        self.plan = plan
        self.reasoning = reasoning
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}


def _chat_prompt(served, body: dict):
    """A chat body's tool plan, its other grammar (response_format's or vLLM's) and prompt parts.

    Returned in that order. This is the slow part of reading a chat, whose messages, tools and
    schemas a body of megabytes can make take a second, so it runs in a worker thread, not on the
    event loop that serves every other request; the template renders in the template pool."""
    messages = normalise_messages(body.get("messages"), images=served.images,
                                  model=served.model_name)
    sources = image_sources(body["messages"])  # checked by normalise_messages
    if sources and served.chat_template is None:  # Jan's prompt pieces: the marker as text
        messages = with_markers(messages, served.images.marker)
    plan = tool_plan(body, parser=served.config.tool_call_parser,
                     auto_parses=served.config.enable_auto_tool_choice)
    constraint = guided.constraint(body, tool_grammar=plan.grammar)
    parts = chat_prompt_parts(served.chat_template, messages, plan, fallback=served.chat_prompt,
                              template_kwargs=chat_template_kwargs(body),
                              ending=vllm_fields.generation_prompt(body, messages))
    return plan, constraint, parts, sources


def _chat_request_parts(served, body: dict):
    """_chat_prompt's, and the sampling fields (whose logit_bias may be 100,000 entries)."""
    return *_chat_prompt(served, body), sampling_and_stops(body, served.validation_limits)


async def _rendered(templates: TemplatePool, served, parts: ChatPromptParts) -> str:
    prompt = parts.text if parts.job is None else await templates.render(served.chat_template,
                                                                         parts.job)
    return vllm_fields.continued(prompt, parts.continue_final)


async def _prompt_images(request: web.Request, served, prompt: str, sources: list
                         ) -> tuple[str, list[LoadedImage]]:
    """The prompt to tokenize, each image's marker expanded, and the images, read and checked."""
    if not sources:
        return prompt, []
    loaded = await load_images(sources, request.app[STATE].media)
    return expanded(prompt, served.images, loaded), loaded


async def _validate_chat(request: web.Request, served, body: dict,
                         adapter_id: str | None) -> _Chat:
    limits = served.validation_limits
    chosen_adapter(adapter_id, served.adapters)  # one being unloaded is refused from the start
    plan, constraint, parts, sources, parsed = await asyncio.to_thread(_chat_request_parts,
                                                                       served, body)
    prompt = await _rendered(request.app[STATE].templates, served, parts)
    with about_field("messages"):  # the prompt's length, which the messages make
        text, loaded = await _prompt_images(request, served, prompt, sources)
        input_ids = await served.tokenizer.encode_async(text, add_special_tokens=False,
                                                       max_tokens=limits.tokens.max_input_tokens)
        images = placed(input_ids, served.images, loaded) if loaded else []
    logprobs = read_flag(body, "logprobs")
    top_logprobs = read_number(body, "top_logprobs", 0, limits.max_top_n_tokens, integer=True) or 0
    if top_logprobs and not logprobs:
        raise ValidationError("`top_logprobs` needs `logprobs: true`")
    request = build_request(prompt, input_ids, body, limits,
                            skip_special_tokens=plan.skips_special_tokens,
                            default_max_tokens=served.request_defaults.get("token_limit"),
                            top_n_tokens=top_logprobs, grammar_spec=plan.grammar or constraint,
                            parsed=parsed, adapter_id=adapter_id, prompt_field="messages",
                            images=images)
    prompt_top_n = vllm_fields.prompt_logprobs(body, limits.max_top_n_tokens)
    request = vllm_fields.with_prompt_logprobs(request, prompt_top_n)
    options = ChatOptions(n=choice_count(body, served.config.max_client_batch_size),
                          stream=read_flag(body, "stream"), include_usage=include_usage(body),
                          logprobs=logprobs, top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_top_n is not None,
                          continuous_usage=vllm_fields.continuous_usage(body))
    reasoning = None
    if served.config.reasoning_parser and request.grammar is None:
        reasoning = starts_in_reasoning(prompt)
    return _Chat(request, options, plan, reasoning,
                 model=adapter_id or served.model_name)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    vllm_fields.UNKNOWN.check(body, vllm_fields.CHAT_FIELDS, "/v1/chat/completions")
    served, adapter_id = model_and_adapter(request, model_name(body))
    body = with_model_defaults(body, served.request_defaults)
    with adapter_as_model():
        chat = await served.infer.count_request(_validate_chat(request, served, body,
                                                               adapter_id))
        requests = copies(chat.request, chat.options.n)
        if chat.options.stream:
            return await serve_stream(request, served.infer.stream_many(requests),
                                      ChatStream(chat, len(requests)), streams=len(requests))
        results = await served.infer.generate_many(requests)
    choices = []
    for index, result in enumerate(results):
        message, finish = _message(result, chat.plan, chat.request.stopping.stop_sequences,
                                   chat.reasoning)
        choices.append({"index": index, "message": message, "finish_reason": finish,
                        "logprobs": _chat_logprobs(result) if chat.options.logprobs else None})
    completion = sum(r.final.generated_tokens for r in results)
    answer = {**chat.envelope("chat.completion"), "choices": choices,
              "usage": usage(chat.request.input_length, completion)}
    if chat.options.prompt_logprobs:  # vLLM's: the answer's, not a choice's (one prompt)
        answer["prompt_logprobs"] = vllm_fields.prompt_logprobs_entries(
            results[0].prefill, results[0].prefill_top_tokens)
    return web.json_response(answer)


class ChatStream(OpenAIStream):
    """chat.completion.chunk per token (tool calls as they are written), then the usage."""

    def __init__(self, chat: _Chat, n: int):
        self.chat = chat
        self.n = n
        self.completion_tokens = 0
        self.holdbacks = [StopHoldback(chat.request.stopping.stop_sequences) for _ in range(n)]
        self.splitters = [ThinkSplitter(chat.reasoning) if chat.reasoning is not None else None
                          for _ in range(n)]
        self.readings = [CallReading(chat.plan.reader(), chat.plan.parallel,
                                     chat.plan.new_call_id)
                         if chat.plan.reads_calls else None for _ in range(n)]
        self.running = vllm_fields.RunningUsage([chat.request.input_length] * n,
                                                chat.options.continuous_usage)

    def _chunk(self, **fields) -> bytes:
        return openai_sse({**self.chat.envelope("chat.completion.chunk"), **fields})

    def event(self, index: int, event: TokenEvent) -> list[bytes]:
        if event.final is not None:
            self.completion_tokens += event.final.generated_tokens
        choices = _chat_chunks(self.chat, index, event, self.holdbacks[index],
                               self.splitters[index], self.readings[index])
        running = self.running.after(index, event)
        return [self._chunk(choices=[choice], **running) for choice in choices]

    def closing(self) -> list[bytes]:
        if not self.chat.options.include_usage:
            return []
        return [self._chunk(choices=[], usage=usage(self.chat.request.input_length,
                                                    self.completion_tokens))]


def _chat_chunks(chat: _Chat, index: int, event, holdback: StopHoldback,
                 splitter: ThinkSplitter | None, reading: CallReading | None) -> list[dict]:
    """A token's choices for chunks: one, or one per piece of the calls it completes."""
    logprobs = None
    if chat.options.logprobs:
        logprobs = {"content": [{**_token_logprob(event.token),
                                 "top_logprobs": [_token_logprob(a) for a in event.top_tokens]}]}
    finish = FINISH[event.final.finish_reason] if event.final is not None else None
    text = holdback.text("" if _eos_text(event.token, event.final) else event.token.text,
                         event.final)
    delta = {"role": "assistant", "content": text}
    if splitter is not None:
        # a chunk per token still (its logprobs go with it), its text split: TGI's delta schema
        # wants a content string, "" while the model thinks
        thought, delta["content"] = splitter.feed(text)
        if event.final is not None:
            held_thought, held_answer = splitter.finish()
            thought, delta["content"] = thought + held_thought, delta["content"] + held_answer
        if thought:
            delta["reasoning_content"] = thought
    if reading is None:
        return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    pieces = [reading.stream_delta(d)
              for d in reading.feed(delta["content"], last=event.final is not None)]
    if "reasoning_content" in delta:
        pieces.insert(0, {**delta, "content": ""})
    if not pieces:
        if logprobs is None and finish is None:
            return []  # a call's text not yet read (a name half written)
        pieces = [{"role": "assistant", "content": ""}]
    if finish is not None:
        finish = reading.finish_reason(finish)
    choices = [{"index": index, "delta": piece, "logprobs": None, "finish_reason": None}
               for piece in pieces]
    choices[0]["logprobs"], choices[-1]["finish_reason"] = logprobs, finish
    return choices


async def chat_tokenize(request: web.Request) -> web.Response:
    """TGI's /chat_tokenize: a chat request's prompt as the template renders it, and its tokens."""
    body = await read_object(request)
    served, _ = model_and_adapter(request, model_name(body))  # an adapter's: its model's template
    _, _, parts, sources = await asyncio.to_thread(_chat_prompt, served, body)
    prompt = await _rendered(request.app[STATE].templates, served, parts)
    # the tokens the model reads: each image's expanded, as the request would be
    text, loaded = await _prompt_images(request, served, prompt, sources)
    ids, offsets = await served.tokenizer.encode_offsets_async(text, add_special_tokens=False)
    if loaded:
        placed(ids, served.images, loaded)  # the same 422 as the request's
    return await tokens_response(text, ids, offsets, templated_text=text)


def register(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat_tokenize", chat_tokenize)
