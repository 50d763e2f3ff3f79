"""Whether a request's images fit its prompt and the model; each image preprocessed for its chunk.

A request whose images cannot be computed is refused alone (shard.admission), with the reason."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.batch_state import NewRequest, PromptImage
from shard.images.tokens import ImageTokens
from shard.models.mrope import rope_delta


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What a vision-language model takes: its placeholder scheme and its preprocessing."""

    tokens: ImageTokens  # the model's placeholder scheme
    preprocess: Callable[[bytes], torch.Tensor]  # a file -> pixel values for the tower
    # where an image's tokens depend on its size (tokens.per_image 0): a file -> (rows, columns)
    grid: Callable[[bytes], tuple[int, int]] | None = None


def image_support(model: torch.nn.Module, preprocess) -> ImageSupport | None:
    """The model's ImageSupport, or None for a model that takes no images."""
    tokens = getattr(model, "image_tokens", None)
    if tokens is None or preprocess is None:
        return None
    return ImageSupport(tokens, preprocess, None if tokens.per_image else preprocess.grid)


def check_images(request: NewRequest, support: ImageSupport | None) -> None:
    """Raises ValueError saying why the request's images cannot be computed.

    Else preprocesses the images that this forward computes (those from cache_len to the chunk's
    end; the ones before are cached already)."""
    if not request.images:
        return
    rid = request.id
    if support is None:
        raise ValueError(f"request {rid} has images, but the model takes no images")
    if request.input_embeds is not None:
        raise ValueError(f"request {rid} gives both input embeddings and images")
    tokens, previous_end = support.tokens, 0
    for i, image in enumerate(request.images):
        expected = _token_count(support, image, f"request {rid}: image {i}")
        if image.count != expected:
            raise ValueError(f"request {rid}: image {i} spans {image.count} tokens, but the "
                             f"model gives it {expected}")
        if image.offset < previous_end or image.end > len(request.input_ids):
            raise ValueError(f"request {rid}: image {i}'s tokens {image.offset}..{image.end - 1} "
                             "overlap another image's or run past the prompt")
        if any(t != tokens.token_id for t in request.input_ids[image.offset:image.end]):
            raise ValueError(f"request {rid}: image {i}'s span holds tokens other than the image "
                             f"placeholder {tokens.token_id}")
        previous_end = image.end
    if support.grid is not None:
        request.rope_delta = rope_delta(request.images)
    start, end = computed_range(request)
    for i, image in enumerate(request.images):
        # an image's rows come whole from the tower: its span is computed in one forward
        if image.offset < start < image.end or image.offset < end < image.end:
            raise ValueError(f"request {rid}: the tokens computed ({start}..{end - 1}) split "
                             f"image {i}'s span {image.offset}..{image.end - 1}")
    for i, image in enumerate(request.images):
        if start <= image.offset and image.end <= end:
            try:
                image.pixels = support.preprocess(image.data)
            except ValueError as err:
                raise ValueError(f"request {rid}: image {i}: {err}") from None


def _token_count(support: ImageSupport, image: PromptImage, what: str) -> int:
    """The tokens the model gives `image`; its grid set where they depend on its size.

    Every image's, cached or not: the positions after it depend on its grid."""
    if support.grid is None:
        return support.tokens.per_image
    try:
        image.grid = support.grid(image.data)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    return image.grid[0] * image.grid[1]


def computed_range(request: NewRequest) -> tuple[int, int]:
    """The prompt positions this prefill computes: from cache_len to its chunk's end."""
    end = (request.cache_len + request.chunk_len if request.is_partial_chunk
           else request.prompt_length)
    return request.cache_len, end
