"""SGLang's choice of LoRA adapter per prompt: `lora_path` and `lora_id`.

`lora_path` is a loaded adapter's name, or the directory it was loaded from; `lora_id` a name.
Either comes once for every prompt or one per prompt. What SGLang refuses here it answers with a
400, and so do we.
"""
from __future__ import annotations

from typing import Protocol

from router.errors import UnknownAdapterError, ValidationError
from router.inputs.validation import AdapterRegistry, chosen_adapter


class LoadedAdapters(AdapterRegistry, Protocol):
    """What SGLang's routes read of a served model's adapters (router.lifecycle.adapters)."""

    def resolve_path(self, path: str) -> str | None: ...  # the open adapter loaded from `path`


class SglangBadRequest(ValidationError):
    """A validation error SGLang answers with a 400.

    Our other validation errors are 422s. These are a LoRA adapter it has not loaded, and a
    `lora_path` list that is not one entry per prompt."""

    status = 400


def _lora_values(body: dict, name: str, count: int) -> list[str | None]:
    """`lora_path` or `lora_id`, one value per prompt.

    Given as one value for every prompt, or (a batch) a list of one per prompt; null and "" are the
    base model."""
    value = body.get(name)
    values = value if isinstance(value, list) else [value] * count
    if not all(v is None or isinstance(v, str) for v in values):
        raise SglangBadRequest(f"`{name}` must be a string, or a list of one string (or null) per "
                               "prompt")
    if len(values) != count:
        raise SglangBadRequest(f"`{name}` holds {len(values)} values for {count} prompts")
    return values


def _adapter(value: str | None, name: str, adapters: LoadedAdapters | None) -> str | None:
    """A loaded adapter's name, given as itself or as its directory.

    The directory comes in `lora_path`, as SGLang's lora_path names an adapter by the path it was
    loaded under."""
    try:
        return chosen_adapter(value, adapters)
    except UnknownAdapterError as err:
        # resolve_path finds only adapters open to requests (not one being unloaded)
        by_path = (adapters.resolve_path(value) if adapters is not None and name == "lora_path"
                   else None)
        if by_path is None:
            raise SglangBadRequest(f"`{name}`: {err.message}") from None
        return by_path


def prompt_adapters(body: dict, count: int,
                    adapters: LoadedAdapters | None) -> list[str | None]:
    """Each prompt's LoRA adapter (None: the base model).

    By `lora_path` or `lora_id` (SGLang's newer field, a name); both given must name the same
    adapter."""
    chosen = []
    for index, (path, name) in enumerate(zip(_lora_values(body, "lora_path", count),
                                             _lora_values(body, "lora_id", count))):
        by_path = _adapter(path, "lora_path", adapters)
        by_name = _adapter(name, "lora_id", adapters)
        if path and name and by_path != by_name:
            where = f" for prompt {index}" if count > 1 else ""
            raise SglangBadRequest(f"`lora_path` ({path!r}) and `lora_id` ({name!r}) name "
                                   f"different adapters{where}; give one of them")
        chosen.append(by_path or by_name)
    return chosen
