"""Which models take images, read from config.json, and what an image becomes in their prompts.

A family module (gemma3.py) turns a config.json of its architecture into an ImageFamily; a model
whose architecture no family knows reads text only.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router.inputs.images import gemma3

log = logging.getLogger("tgi.router")


@dataclass(frozen=True, slots=True)
class ImageFamily:
    """How one model's prompts hold images."""

    architecture: str
    marker: str  # what a prompt (a chat template's output) writes where an image goes
    expansion: str  # the text each marker becomes before tokenization
    image_token_id: int  # the placeholder token the vision tower's rows replace
    tokens_per_image: int  # placeholder tokens of one image


# config.json's architecture -> its family's reader: (config, token id -> text) -> the family's
# (marker, expansion, image token id, tokens per image), or a ValueError saying what is missing
_FAMILIES: dict[str, Callable[[dict, Callable[[int], str | None]], tuple[str, str, int, int]]] = {
    "Gemma3ForConditionalGeneration": gemma3.image_tokens,
}


def names_image_family(model_dir: str | None) -> bool:
    """Whether the config.json in `model_dir` is of an architecture a family knows.

    Said of a model that may not run (GET /v1/models); image_family reads the rest once it does.
    """
    config = _config(model_dir)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(architectures, list) and any(
        isinstance(a, str) and a in _FAMILIES for a in architectures)


def _config(model_dir: str | None) -> dict | None:
    if model_dir is None:
        return None
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a GGUF or a directory without one: text only, as its shards load it


def image_family(model_dir: str | None, token_text: Callable[[int], str | None]
                 ) -> ImageFamily | None:
    """The image family of the model in `model_dir`; None for a model that reads text only.

    `token_text` gives the tokenizer's text of an id (None for an id it lacks). A config.json of
    a family's architecture that lacks what the family needs reads text only, said once here.
    """
    config = _config(model_dir)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    for architecture in architectures if isinstance(architectures, list) else []:
        reader = _FAMILIES.get(architecture)
        if reader is None:
            continue
        try:
            marker, expansion, image_token_id, count = reader(config, token_text)
        except ValueError as err:
            log.warning("%s: %s; the model is served as text only", model_dir, err)
            return None
        return ImageFamily(architecture, marker, expansion, image_token_id, count)
    return None
