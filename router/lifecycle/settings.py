"""What a model's `settings`, `parameters` and `engine_parameters` may hold, checked and normalised.

Jan's schema writes numbers as strings ("2048") and its clients send numbers: both are accepted and
stored as numbers. A key this server would not act on is refused, never stored and ignored.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from router.config.model import ModelSettings
from router.errors import ValidationError

DTYPES = ("float32", "bfloat16", "float16")


def _integer(low: int, high: int = 2**31 - 1) -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,18}\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValidationError(f"`{name}` must be an integer")
        if not low <= value <= high:
            raise ValidationError(f"`{name}` must be between {low} and {high}")
        return value
    return check


def _number(low: float, high: float) -> Callable[[str, object], float]:
    def check(name: str, value: object) -> float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValidationError(f"`{name}` must be a number") from None
        if isinstance(value, float) and value != value:
            raise ValidationError(f"`{name}` must be a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValidationError(f"`{name}` must be a number")
        if not low <= value <= high:
            raise ValidationError(f"`{name}` must be between {low} and {high}")
        return float(value)
    return check


def _boolean(name: str, value: object) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValidationError(f"`{name}` must be true or false")
    return value


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > 10_000:
        raise ValidationError(f"`{name}` must be a string of at most 10000 characters")
    return value


def _stop(name: str, value: object) -> list[str]:
    """Stop strings, as OpenAI's `stop` takes them: one string or a list of up to 4."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(
            isinstance(s, str) and 0 < len(s) <= 1000 for s in stops):
        raise ValidationError(f"`{name}` must be a string or a list of at most 4 strings (each "
                              "1 to 1000 characters)")
    return stops


def _prompt_template(name: str, value: object) -> str:
    """Cortex's prompt template: `{system_message}` (optional) then `{prompt}` (ChatPrompt.of)."""
    text = _text(name, value)
    system, prompt = text.find("{system_message}"), text.find("{prompt}")
    if prompt < 0 or text.count("{prompt}") > 1 or text.count("{system_message}") > 1 \
            or system > prompt:
        raise ValidationError(f"`{name}` must hold `{{prompt}}` once, after at most one "
                              "`{system_message}`, as Cortex's templates do")
    return text


def _dtype(name: str, value: object) -> str:
    if value not in DTYPES:
        raise ValidationError(f"`{name}` must be one of {', '.join(DTYPES)}")
    return value


SETTINGS = {
    "ctx_len": _integer(16),  # the model's context: prompt + output (its max_total_tokens)
    "n_parallel": _integer(1, 4096),  # requests decoded at once (its max_batch_size)
    "ngl": _integer(0),  # 0: on the CPU even when a GPU exists
    # serve embeddings (/v1/embeddings, /embed, /api/embed) of a model not made to embed; a
    # model with sentence-transformers files, or an encoder, serves them without it
    "embedding": _boolean,
    "num_shard": _integer(1, 64),  # tensor-parallel ranks of its shard group
    "dtype": _dtype,
    "max_batch_total_tokens": _integer(16),  # its KV budget in tokens (unset: from free memory)
    "cpu_threads": _integer(1, 1024),  # torch's threads in each of its shards (OMP_NUM_THREADS)
}
PARAMETERS = {
    "temperature": _number(0.0, 2.0),
    "top_k": _integer(0),
    "top_p": _number(0.0, 1.0),
    "token_limit": _integer(1),
    "stream": _boolean,
    "stop": _stop,
    "frequency_penalty": _number(-2.0, 2.0),
    "presence_penalty": _number(-2.0, 2.0),
}
ENGINE_PARAMETERS = {**{key: _text for key in ("pre_prompt", "system_prompt", "user_prompt",
                                               "ai_prompt")},
                     "prompt_template": _prompt_template}


def model_settings(defaults: ModelSettings, *, model_id: str, model_dir: str, master_socket: str,
                   settings: dict) -> ModelSettings:
    """The settings of a model started through the model routes, from `defaults` (the flags').

    Its own directory and socket, and the limits its registry `settings` give; the limits they
    leave out are derived from the model when it starts (router/lifecycle/limits.py), not taken
    from the flags, which are the default model's.
    """
    return dataclasses.replace(
        defaults, model_id=model_id, tokenizer_path=model_dir, master_shard_uds_path=master_socket,
        tokenizer_config_path=None,  # the default model's
        max_input_tokens=None, max_total_tokens=settings.get("ctx_len"),
        max_batch_prefill_tokens=None, max_batch_size=settings.get("n_parallel"),
        max_batch_total_tokens=settings.get("max_batch_total_tokens"))


def patched(record: object, body: dict) -> dict:
    """What a PATCH `body` changes in a model's `record`, by field; a 422 for what it cannot.

    A group (settings, parameters, engine_parameters) is merged into the record's: a key set to
    null is removed, and must be a key the group takes too.
    """
    tables = {"settings": SETTINGS, "parameters": PARAMETERS,
              "engine_parameters": ENGINE_PARAMETERS}
    for key in body:
        if key not in (*tables, "name", "description"):
            raise ValidationError(f"`{key}` cannot be changed; PATCH takes "
                                  f"{', '.join(tables)}, name and description, and a Cortex "
                                  "model.yml's fields (ctx_len, prompt_template, max_tokens, "
                                  "...)")
    changes = {}
    for group, table in tables.items():
        if group in body:
            given = body[group]
            if isinstance(given, dict):  # a key set to null is removed: it must exist too
                check_keys(group, given, table)
            removed = [k for k, v in (given or {}).items() if v is None] \
                if isinstance(given, dict) else []
            kept = {k: v for k, v in given.items() if v is not None} \
                if isinstance(given, dict) else given
            merged = {**getattr(record, group), **checked(group, kept, table)}
            changes[group] = {k: v for k, v in merged.items() if k not in removed}
    for key in ("name", "description"):
        if key in body:
            if not isinstance(body[key], str) or len(body[key]) > 1000:
                raise ValidationError(f"`{key}` must be a string of at most 1000 characters")
            changes[key] = body[key]
    return changes


def checked(group: str, given: object, table: dict) -> dict:
    """`given` with every value checked; an unknown key or a bad value is a 422."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ValidationError(f"`{group}` must be an object")
    check_keys(group, given, table)
    return {key: table[key](f"{group}.{key}", value) for key, value in given.items()}


def check_keys(group: str, given: dict, table: dict) -> None:
    """A 422 for the first key of `given` that `table` does not know."""
    for key in given:
        if key not in table:
            raise ValidationError(f"`{group}.{key}` is not supported; `{group}` takes "
                                  f"{', '.join(table)}")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Jan's prompt pieces, for a model without a chat template.

    pre_prompt, then each message after its role's prefix (and `separator`), then the assistant's
    prefix to answer after.
    """

    pre_prompt: str = ""
    system_prompt: str = "SYSTEM: "
    user_prompt: str = "USER: "
    ai_prompt: str = "ASSISTANT: "
    separator: str = "\n"

    @classmethod
    def of(cls, engine_parameters: dict) -> "ChatPrompt":
        """The pieces; a Cortex `prompt_template` gives the role prefixes as Cortex splits it.

        The text before `{system_message}` prefixes a system message, the text between it and
        `{prompt}` a user message, the text after `{prompt}` an answer, with nothing between
        messages: a system and a user message make the template filled in."""
        pieces = dict(engine_parameters)
        template = pieces.pop("prompt_template", None)
        if template is None:
            return cls(**pieces)
        before, _, after = template.partition("{prompt}")
        system, found, user = before.partition("{system_message}")
        if not found:
            system, user = "", before
        return cls(**{**pieces, "system_prompt": system, "user_prompt": user,
                      "ai_prompt": after, "separator": ""})

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        prefix = {"system": self.system_prompt, "user": self.user_prompt,
                  "assistant": self.ai_prompt}
        parts = [self.pre_prompt]
        for message in messages:
            content = message.get("content")
            if not isinstance(content, str):
                content = "".join(part.get("text", "") for part in content or []
                                  if isinstance(part, dict))
            parts.append(f"{prefix.get(message.get('role'), self.user_prompt)}{content}"
                         f"{self.separator}")
        if add_generation_prompt:
            parts.append(self.ai_prompt)
        return "".join(parts)
