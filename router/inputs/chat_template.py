"""The model's chat template, rendered in a sandboxed Jinja2 environment as transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import TemplateError


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # templates expect transformers' tojson: unicode kept, keys in their order
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the model's chat template does not parse: {err}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def knows_tools(self) -> bool:
        """Whether the template itself renders `tools` (else the router writes the tool prompt)."""
        return "tools" in self.source

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ChatTemplate | None":
        directory = Path(model_dir)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if source is None and jinja_path.exists():
            source = jinja_path.read_text()
        if not source:
            return None
        return cls(source, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.TemplateError as err:
            raise TemplateError(str(err)) from None
        except (TypeError, KeyError, ValueError, AttributeError) as err:
            raise TemplateError(f"{type(err).__name__}: {err}") from None


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
