"""Qwen2.5-VL's images in the prompt, as transformers' Qwen2_5_VLProcessor writes them.

Its chat template writes "<|vision_start|><|image_pad|><|vision_end|>" for an image part; the
processor repeats <|image_pad|> once per token of the image, and an image's tokens depend on its
size (dynamic resolution): smart_resize picks the sides, multiples of patch * merge pixels within
min and max pixels (preprocessor_config.json's), and each merge x merge square of patches is one
token. The shard computes the same count from the same file and refuses a span that differs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from router.errors import ValidationError
from router.inputs.images.check import ImageSize

_MAX_RATIO = 200  # transformers refuses an image more elongated than this


@dataclass(frozen=True, slots=True)
class Qwen2VLImages:
    """A Qwen2.5-VL model's image tokens (router.inputs.images.family.ImageFamily)."""

    architecture: str
    marker: str  # "<|vision_start|><|image_pad|><|vision_end|>"
    image_token_id: int  # "<|image_pad|>"'s
    start: str
    pad: str
    end: str
    unit: int  # pixels of a token's side: patch_size * merge_size
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_config(cls, architecture: str, config: dict, token_text: Callable[[int], str | None],
                    preprocessor: dict) -> Qwen2VLImages:
        """From config.json and preprocessor_config.json; a ValueError says what they lack."""
        names = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
        ids = [config.get(name) for name in names]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"its config.json lacks one of {', '.join(names)}")
        texts = [token_text(i) for i in ids]
        if None in texts:
            raise ValueError("its tokenizer lacks the image tokens config.json names")
        vision = config.get("vision_config") or {}
        patch = preprocessor.get("patch_size") or vision.get("patch_size") or 14
        merge = preprocessor.get("merge_size") or vision.get("spatial_merge_size") or 2
        size = preprocessor.get("size") or {}
        start, pad, end = texts
        return cls(architecture, start + pad + end, ids[1], start, pad, end, patch * merge,
                   int(preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                   int(preprocessor.get("max_pixels") or size.get("longest_edge")
                       or 28 * 28 * 1280))

    def expansion(self, size: ImageSize) -> str:
        return self.start + self.pad * self.token_count(size) + self.end

    def token_count(self, size: ImageSize) -> int:
        height, width = self._resized(size)
        return (height // self.unit) * (width // self.unit)

    def _resized(self, size: ImageSize) -> tuple[int, int]:
        """transformers' smart_resize: the (height, width) the image is resized to."""
        height, width, factor = size.height, size.width, self.unit
        if max(height, width) > _MAX_RATIO * min(height, width):
            raise ValidationError(f"an image of {width}x{height} pixels is more elongated than "
                                  f"{_MAX_RATIO}:1, which this model does not read")
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar
