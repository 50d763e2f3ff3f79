"""Ollama's /api/generate and /api/chat bodies -> a validated GenerateRequest and how to answer.

The prompt: /api/chat's messages, and /api/generate's `system` and `prompt` as a system and a user
message, rendered with the model's chat template (Jinja, in the template pool), or Jan's prompt
pieces for a model without one; `raw` takes the prompt as written. Ollama's Go `template` is not
served: the model's own template renders. `context` (what an earlier /api/generate answered)
goes before the prompt's tokens. `images` are base64 files for a model that takes images.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from router.errors import TemplateError, ValidationError, about_field
from router.inputs import structured_output
from router.inputs.field_ranges import checked_token_ids
from router.inputs.images.placement import expanded, placed, text_only_refusal
from router.inputs.images.sources import ImageSource, load_images
from router.inputs.template_worker import encode_job
from router.inputs.tool_plan import ToolPlan, tool_plan, with_tool_prompt
from router.lifecycle.served_model import ServedModel
from router.schemas import GenerateRequest, StoppingParams
from router.state import STATE
from router.api.ollama.options import Options, read_options, token_budget

_ROLES = ("system", "user", "assistant", "tool")
# fields each route reads (keep_alive is the routes' own: router/api/ollama/keep_alive.py)
GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "stream", "raw",
                   "format", "images", "options", "keep_alive", "think"}
CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}


@dataclass(frozen=True, slots=True)
class OllamaCall:
    """One /api/generate or /api/chat request, validated: what to generate and how to answer."""

    request: GenerateRequest
    stream: bool
    plan: ToolPlan
    context: list[int] | None  # /api/generate's: the tokens its answer's `context` starts with


def check_fields(body: dict, known: set[str], route: str) -> None:
    for key in body:
        if key not in known:
            raise ValidationError(f"`{key}` is not supported by {route}; it takes "
                                  f"{', '.join(sorted(known))}")


def read_stream(body: dict) -> bool:
    stream = body.get("stream")
    if stream is None:
        return True  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise ValidationError("`stream` must be a boolean")
    return stream


def _check_think(body: dict) -> None:
    if body.get("think") not in (None, False):
        raise ValidationError("`think` is not supported: this server does not separate a "
                              "model's thinking in Ollama's answers")


def _format(value) -> tuple[str, str] | None:
    """`format`: "json" (any JSON object) or a JSON schema, as a grammar; "" or null: none."""
    if value in (None, ""):
        return None
    if value == "json":
        return structured_output.checked(structured_output.JSON, {"type": "object"})
    if isinstance(value, dict):
        with about_field("format"):
            return structured_output.checked(structured_output.JSON, value)
    raise ValidationError("`format` must be \"json\" or a JSON schema object")


def _images(value, where: str) -> list[ImageSource]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValidationError(f"`{where}` must be a list of base64-encoded images")
    return [ImageSource(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _with_images(content: str, count: int) -> str | list[dict]:
    """A message's content with its images before its text, as chat templates read parts."""
    if not count:
        return content
    return [*({"type": "image"} for _ in range(count)), {"type": "text", "text": content}]


def _call_with_object(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError(f"`{where}` must be {{\"function\": {{\"name\": ..., "
                              "\"arguments\": {...}}}")
    return {"type": "function", "function": {"name": function["name"],
                                             "arguments": function.get("arguments") or {}}}


def chat_messages(messages, served: ServedModel) -> tuple[list[dict], list[ImageSource]]:
    """/api/chat's messages as the template gets them, and their images in prompt order."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("`messages` must be a non-empty list")
    out, sources = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ValidationError(f"messages[{i}].role must be one of {', '.join(_ROLES)}")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ValidationError(f"messages[{i}].content must be a string")
        images = _images(message.get("images"), f"messages[{i}].images")
        if images and served.images is None:
            raise text_only_refusal(served.model_name)
        sources += images
        item = {"role": message["role"], "content": _with_images(content, len(images))}
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ValidationError(f"messages[{i}].tool_calls must be a list")
            item["tool_calls"] = [_call_with_object(c, f"messages[{i}].tool_calls[{j}]")
                                  for j, c in enumerate(calls)]
        if message.get("tool_name") is not None:
            item["name"] = message["tool_name"]
        out.append(item)
    return out, sources


def generate_messages(body: dict, served: ServedModel
                      ) -> tuple[list[dict], list[ImageSource]]:
    """/api/generate's system and prompt as chat messages, and the prompt's images."""
    prompt, system = body.get("prompt") or "", body.get("system")
    if not isinstance(prompt, str):
        raise ValidationError("`prompt` must be a string")
    if system is not None and not isinstance(system, str):
        raise ValidationError("`system` must be a string")
    sources = _images(body.get("images"), "images")
    if sources and served.images is None:
        raise text_only_refusal(served.model_name)
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": _with_images(prompt, len(sources))}], sources


async def _rendered(request: web.Request, served: ServedModel, messages: list[dict],
                    plan: ToolPlan) -> str:
    template = served.chat_template
    if plan.functions:
        messages = with_tool_prompt(messages, plan, template_shows_tools=template is not None
                                    and template.knows_tools)
    if template is None:
        if served.chat_prompt is None:
            raise TemplateError("this model has no chat template")
        return served.chat_prompt.render(
            [{**m, "content": _marked(m["content"], served)} for m in messages])
    tools = [{"type": "function", "function": f} for f in plan.functions or []] or None
    job = encode_job(template.source, template.variables(messages, tools=tools))
    return await request.app[STATE].templates.render(template, job)


def _marked(content, served: ServedModel) -> str:
    """Content as text for Jan's prompt pieces: each image its marker."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p["type"] == "text" else served.images.marker for p in content)


def _context(body: dict, served: ServedModel) -> list[int]:
    context = body.get("context")
    if context is None:
        return []
    if not isinstance(context, list):
        raise ValidationError("`context` must be a list of token ids (an earlier answer's)")
    return checked_token_ids(context, "context", served.validation_limits.vocab_size)


async def read_call(request: web.Request, served: ServedModel, body: dict, *,
                    chat: bool, adapter_id: str | None = None) -> OllamaCall:
    """A validated /api/chat (`chat`) or /api/generate body."""
    _check_think(body)
    options: Options = read_options(body.get("options"), served.validation_limits)
    grammar = _format(body.get("format"))
    if chat:
        plan = tool_plan({"tools": body.get("tools")} if body.get("tools") else {},
                         parser=served.config.tool_call_parser,
                         auto_parses=served.config.enable_auto_tool_choice)
        if plan.grammar is not None and grammar is not None:
            raise ValidationError("`format` and `tools` cannot be given together: the tools' "
                                  "calls have a format of their own")
        messages, sources = await asyncio.to_thread(chat_messages, body.get("messages"), served)
        prompt, context, raw = await _rendered(request, served, messages, plan), [], False
    else:
        plan = ToolPlan()
        for field in ("template", "suffix"):
            if body.get(field):
                raise ValidationError(
                    f"`{field}` is not supported: " + (
                        "the model's own chat template (Jinja) renders the prompt; Ollama's Go "
                        "templates are not served (write the prompt out with raw: true)"
                        if field == "template" else "this server does not fill in the middle"))
        raw = body.get("raw") or False
        if not isinstance(raw, bool):
            raise ValidationError("`raw` must be a boolean")
        messages, sources = generate_messages(body, served)
        untemplated = served.chat_template is None and served.chat_prompt is None
        if raw or untemplated:
            if sources and raw:
                raise ValidationError("`images` cannot go with raw: true: the template places "
                                      "them")
            prompt = body.get("prompt") or ""
        else:
            prompt = await _rendered(request, served, messages, plan)
        raw = raw or untemplated
        context = _context(body, served)
    loaded = await load_images(sources, request.app[STATE].media, bare_base64=True) \
        if sources else []
    text = expanded(prompt, served.images, loaded) if loaded else prompt
    limits = served.validation_limits
    with about_field("messages" if chat else "prompt"):
        ids = await served.tokenizer.encode_async(
            text, add_special_tokens=raw and not context,
            max_tokens=limits.tokens.max_input_tokens)
        ids = context + ids
        images = placed(ids, served.images, loaded) if loaded else []
        max_new = token_budget(options, len(ids), limits)
    request_ = GenerateRequest(
        inputs=prompt, input_ids=ids, sampling=options.sampling,
        stopping=StoppingParams(max_new_tokens=max_new, stop_sequences=options.stop),
        grammar=plan.grammar or grammar, skip_special_tokens=plan.skips_special_tokens,
        images=images, adapter_id=adapter_id)
    return OllamaCall(request_, read_stream(body), plan, ids if not chat else None)
