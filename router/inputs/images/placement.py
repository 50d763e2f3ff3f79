"""A prompt's images placed in it: markers expanded before tokenization, then each over its tokens.

A prompt (a chat template's output, TGI's `![](url)` markdown made markers) holds one marker per
image; each becomes its family's expansion, and once tokenized, each run of the image token is
one image's span, in order.
"""
from __future__ import annotations

import re

from router.errors import ValidationError
from router.inputs.images.family import ImageFamily
from router.inputs.images.sources import ImageSource, LoadedImage, MediaLimits, load_images
from router.schemas import PromptImage

# TGI's syntax for an image in /generate's inputs (its router's regex): an empty alt text
MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)]*)\)")


def text_only_refusal(model: str) -> ValidationError:
    """The 422 of an image sent to a model that reads text only."""
    return ValidationError(f"image inputs are not supported: model {model[:200]!r} takes no "
                           "images, it reads text only")


def markdown_images(text: str, family: ImageFamily, what: str) -> tuple[str, list[ImageSource]]:
    """`text` with each `![](url)` made the family's marker, and the images' sources in order."""
    sources: list[ImageSource] = []

    def marker(match: re.Match) -> str:
        sources.append(ImageSource(match.group(1).strip(), f"{what} image {len(sources)}"))
        return family.marker

    return MARKDOWN_IMAGE.sub(marker, text), sources


async def markdown_prompt(text: str, family: ImageFamily, media: MediaLimits, what: str
                          ) -> tuple[str, list[LoadedImage]]:
    """A TGI prompt to tokenize, each `![](url)` its image's expansion, and the images."""
    marked, sources = markdown_images(text, family, what)
    if not sources:
        return text, []
    loaded = await load_images(sources, media)
    return expanded(marked, family, loaded), loaded


def expanded(text: str, family: ImageFamily, images: list[LoadedImage]) -> str:
    """The prompt to tokenize: the i-th image marker made the i-th image's expansion."""
    if not images:
        return text
    pieces = text.split(family.marker)
    if len(pieces) - 1 != len(images):
        raise ValidationError(f"the prompt holds {len(pieces) - 1} image markers "
                              f"({family.marker!r}) for {len(images)} images: each image goes "
                              "where one marker is")
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        out += [family.expansion(image.size), piece]
    return "".join(out)


def placed(input_ids: list[int], family: ImageFamily, images: list[LoadedImage]
           ) -> list[PromptImage]:
    """Each image over its run of image tokens in `input_ids`, in order."""
    if not images:
        return []
    spans, start = [], None
    for i, token in enumerate([*input_ids, None]):
        if token == family.image_token_id and start is None:
            start = i
        elif token != family.image_token_id and start is not None:
            spans.append((start, i - start))
            start = None
    if len(spans) != len(images) or any(n != family.token_count(image.size)
                                        for image, (_, n) in zip(images, spans)):
        raise ValidationError(f"the prompt's image tokens do not match its {len(images)} images "
                              f"({len(spans)} runs of the image token): a prompt may not write "
                              "image tokens itself, nor be truncated inside an image")
    return [PromptImage(image.data, image.digest, offset, count)
            for image, (offset, count) in zip(images, spans)]
