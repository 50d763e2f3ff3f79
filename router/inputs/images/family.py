"""Which models take images, read from config.json, and what an image becomes in their prompts.

A family module (gemma3.py, qwen2_vl.py) turns a config.json of its architecture into its
ImageFamily; a model whose architecture no family knows reads text only. A family whose image
tokens depend on the image's size (Qwen2.5-VL's dynamic resolution) says so through expansion and
token_count; preprocessor_config.json says how it resizes.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from router.inputs.images.check import ImageSize
from router.inputs.images.gemma3 import Gemma3Images
from router.inputs.images.qwen2_vl import Qwen2VLImages

log = logging.getLogger("tgi.router")


class ImageFamily(Protocol):
    """How one model's prompts hold images (a family module's class, e.g. gemma3.Gemma3Images)."""

    architecture: str
    marker: str  # what a prompt (a chat template's output) writes where an image goes
    image_token_id: int  # the placeholder token the vision tower's rows replace

    def expansion(self, size: ImageSize) -> str:
        """The text an image of `size` makes of its marker, before tokenization."""

    def token_count(self, size: ImageSize) -> int:
        """The placeholder tokens of an image of `size` (those its expansion holds)."""


# config.json's architecture -> its family's constructor (architecture, config, token id -> text,
# preprocessor_config.json), which raises a ValueError saying what is missing
_FAMILIES: dict[str, Callable[[str, dict, Callable[[int], str | None], dict], ImageFamily]] = {
    "Gemma3ForConditionalGeneration": Gemma3Images.from_config,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLImages.from_config,
}


def names_image_family(model_dir: str | None) -> bool:
    """Whether the config.json in `model_dir` is of an architecture a family knows.

    Said of a model that may not run (GET /v1/models); image_family reads the rest once it does.
    """
    config = _config(model_dir)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(architectures, list) and any(
        isinstance(a, str) and a in _FAMILIES for a in architectures)


def _config(model_dir: str | None, name: str = "config.json") -> dict | None:
    if model_dir is None:
        return None
    try:
        return json.loads((Path(model_dir) / name).read_text())
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
        family = _FAMILIES.get(architecture)
        if family is None:
            continue
        try:
            preprocessor = _config(model_dir, "preprocessor_config.json")
            return family(architecture, config, token_text,
                          preprocessor if isinstance(preprocessor, dict) else {})
        except ValueError as err:
            log.warning("%s: %s; the model is served as text only", model_dir, err)
            return None
    return None
