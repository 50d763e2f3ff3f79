"""Gemma 3's images in the prompt, as transformers' Gemma3Processor writes them.

Its chat template writes "<start_of_image>" for an image part; the processor replaces each with
"\n\n<start_of_image>", mm_tokens_per_image "<image_soft_token>", "<end_of_image>\n\n" (without
pan-and-scan crops, its default), and the vision tower's rows replace the soft tokens.
"""
from __future__ import annotations

from collections.abc import Callable


def image_tokens(config: dict, token_text: Callable[[int], str | None]
                 ) -> tuple[str, str, int, int]:
    """(marker, its expansion, the image token id, tokens per image) of a Gemma 3 config.json."""
    names = ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index")
    values = [config.get(name) for name in names]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"its config.json lacks one of {', '.join(names)}")
    count, boi, eoi, image = values
    texts = [token_text(i) for i in (boi, eoi, image)]
    if None in texts:
        raise ValueError("its tokenizer lacks the image tokens config.json names (boi, eoi, "
                         "image_token_index)")
    start, end, soft = texts
    return start, f"\n\n{start}{soft * count}{end}\n\n", image, count
