"""How a vision-language model's prompt holds an image: the router's expansion, the shard's mask."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """A family's image placeholders (a model's `image_tokens`; None for a text-only model)."""

    token_id: int  # the placeholder repeated per_image times, which the image's rows replace
    per_image: int  # 0: as many as the image's grid of tokens has cells (Qwen2.5-VL's)
    start_id: int  # the token before the run (Gemma 3's <start_of_image>)
    end_id: int  # and after it (<end_of_image>)
    bidirectional: bool  # an image's tokens see each other both ways, not causally
