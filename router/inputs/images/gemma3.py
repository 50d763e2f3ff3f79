"""Gemma 3's images in the prompt, as transformers' Gemma3Processor writes them.

Its chat template writes "<start_of_image>" for an image part; the processor replaces each with
"\n\n<start_of_image>", mm_tokens_per_image "<image_soft_token>", "<end_of_image>\n\n" (without
pan-and-scan crops, its default), whatever the image's size, and the vision tower's rows replace
the soft tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.inputs.images.check import ImageSize


@dataclass(frozen=True, slots=True)
class Gemma3Images:
    """A Gemma 3 model's image tokens (router.inputs.images.family.ImageFamily)."""

    architecture: str
    marker: str  # "<start_of_image>"
    image_token_id: int  # "<image_soft_token>"'s
    tokens_per_image: int  # config.json's mm_tokens_per_image
    sequence: str  # what every marker becomes

    @classmethod
    def from_config(cls, architecture: str, config: dict,
                    token_text: Callable[[int], str | None],
                    preprocessor: dict | None = None) -> Gemma3Images:
        """From a config.json; a ValueError says what it or the tokenizer lacks."""
        names = ("mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                 "image_token_index")
        values = [config.get(name) for name in names]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"its config.json lacks one of {', '.join(names)}")
        count, boi, eoi, image = values
        texts = [token_text(i) for i in (boi, eoi, image)]
        if None in texts:
            raise ValueError("its tokenizer lacks the image tokens config.json names (boi, eoi, "
                             "image_token_index)")
        start, end, soft = texts
        return cls(architecture, start, image, count, f"\n\n{start}{soft * count}{end}\n\n")

    def expansion(self, size: ImageSize) -> str:
        return self.sequence

    def token_count(self, size: ImageSize) -> int:
        return self.tokens_per_image
