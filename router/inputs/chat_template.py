"""The model's chat template, rendered as transformers renders it.

As transformers' apply_chat_template renders it: the same sandboxed Jinja2 environment (trim_blocks,
lstrip_blocks, loopcontrols, `{% generation %}`, raise_exception, strftime_now, its tojson, dict and
namespace) and the same variables (the messages without their null fields, tools, documents,
add_generation_prompt, the special tokens), within a budget (router/inputs/template_budget.py).

A template that does not compile is kept with its error: the chat routes answer it as a 422 while
every other route serves, where raising would end the router at start. The router renders in the
worker processes of its template pool (router/inputs/template_pool.py), never in its own.
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from router.errors import TemplateError
from router.inputs.template_budget import (BudgetedEnvironment, RenderBudget,
                                           TemplateBudgetError)

# the named special tokens transformers passes every template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
# names a message's reasoning comes under; templates read reasoning_content, gpt-oss's thinking
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter, its argument order included (Jinja's own escapes HTML and sorts keys)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` as a template sees it: building dicts only, none of the type's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore names, as transformers' does.

    A template then has no way to CPython's insides."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}` tag: its body renders as it is.

    `{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks;
    apply_chat_template too renders its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _environment(budget: RenderBudget) -> BudgetedEnvironment:
    environment = BudgetedEnvironment(
        budget, trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to the template.

    Its null fields dropped (templates test whether a key is there), its reasoning under every name
    templates read it by."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _compile_error(err: jinja2.TemplateError) -> str:
    where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
    return f"the model's chat template does not compile: {err.message or err}{where}"


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 budget: RenderBudget = RenderBudget()):
        self.source = source
        tokens = dict(special_tokens or {})
        if bos_token is not None:
            tokens["bos_token"] = bos_token
        if eos_token is not None:
            tokens["eos_token"] = eos_token
        self.special_tokens = tokens
        self.template: jinja2.Template | None = None
        # whether the template reads the `tools` variable (TGI's test), not a message's `tools`
        # field as Phi-4-mini's does: else the router writes the tools into the prompt
        self.knows_tools = False
        # why the template cannot render, for every chat request to answer with a 422
        self.error: str | None = None
        if not isinstance(source, str):
            self.error = (f"the model's chat template is a {type(source).__name__}, not the "
                          "text of a Jinja template")
            return
        # names the template's standing in the pool: the same text is the same template
        self.digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        self.environment = _environment(budget)
        try:
            self.template = self.environment.from_string(source)
            self.knows_tools = any(
                name.name == "tools" and name.ctx == "load"
                for name in self.environment.parse(source).find_all(jinja2.nodes.Name))
        except jinja2.TemplateError as err:
            self.error = _compile_error(err)
        except (RecursionError, SyntaxError, MemoryError) as err:  # nested past Python's limits
            self.error = (f"the model's chat template does not compile: {type(err).__name__} "
                          f"({err})")

    @property
    def bos_token(self) -> str:
        return self.special_tokens.get("bos_token", "")

    @property
    def eos_token(self) -> str:
        return self.special_tokens.get("eos_token", "")

    @classmethod
    def from_model_dir(cls, model_dir: str,
                       config_file: str | None = None) -> "ChatTemplate | None":
        """The chat template of a model directory; None if it has none.

        `config_file`: the tokenizer_config.json to read in place of the directory's
        (--tokenizer-config-path)."""
        directory = Path(model_dir)
        config_path = Path(config_file) if config_file else directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if source is None and jinja_path.exists():
            source = jinja_path.read_text()
        if source is None or source == "":
            return None
        tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS
                  if config.get(name) is not None}
        return cls(source, special_tokens=tokens)

    def variables(self, messages: list[dict], *, add_generation_prompt: bool = True,
                  tools: list[dict] | None = None, extra: dict | None = None) -> dict:
        """The variables the template renders `messages` with.

        `extra`: more template variables (a request's chat_template_kwargs), which may replace the
        special tokens as in transformers, never the variables named here."""
        return {**self.special_tokens, "documents": None, **(extra or {}),
                "messages": [_template_message(m) for m in messages], "tools": tools,
                "add_generation_prompt": add_generation_prompt}

    def render(self, messages: list[dict], **options) -> str:
        """The prompt of `messages` (options: variables()'s), rendered in this process."""
        return self.render_variables(self.variables(messages, **options))

    def render_variables(self, variables: dict) -> str:
        """The prompt the template renders from `variables`, within its budget.

        A MemoryError passes through: the process that renders decides what it means."""
        if self.template is None:
            raise TemplateError(self.error)
        self.environment.start_render()
        try:
            prompt = self.template.render(variables)
        except (TemplateError, MemoryError):
            raise
        except jinja2.TemplateError as err:
            raise TemplateError(str(err)) from None
        except RecursionError:
            raise TemplateError("the chat template recursed too deeply") from None
        except Exception as err:  # noqa: BLE001 - the template's code and the request's values
            # fail it (a TypeError, a sandbox's OverflowError...): the request's 422, not a 500
            raise TemplateError(f"{type(err).__name__}: {err}") from None
        budget = self.environment.budget
        if len(prompt) > budget.max_chars:
            raise TemplateBudgetError(f"the chat template rendered {len(prompt):,} characters, "
                                      f"over its limit of {budget.max_chars:,}")
        return prompt


def _token_text(token) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return str(token)
