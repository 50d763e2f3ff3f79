"""Whether a request's images fit its prompt and the model; each image preprocessed for its chunk.

A request whose images cannot be computed is refused alone (shard.admission), with the reason."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.batch_state import NewRequest


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """What a vision-language model takes: its placeholder scheme and its preprocessing."""

    tokens: object  # the model's ImageTokens (e.g. shard.models.gemma3_vision.ImageTokens)
    preprocess: Callable[[bytes], torch.Tensor]  # a file -> pixel values for the tower


def image_support(model: torch.nn.Module, preprocess) -> ImageSupport | None:
    """The model's ImageSupport, or None for a model that takes no images."""
    tokens = getattr(model, "image_tokens", None)
    return None if tokens is None or preprocess is None else ImageSupport(tokens, preprocess)


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
        if image.count != tokens.per_image:
            raise ValueError(f"request {rid}: image {i} spans {image.count} tokens, but the "
                             f"model gives {tokens.per_image} per image")
        if image.offset < previous_end or image.end > len(request.input_ids):
            raise ValueError(f"request {rid}: image {i}'s tokens {image.offset}..{image.end - 1} "
                             "overlap another image's or run past the prompt")
        if any(t != tokens.token_id for t in request.input_ids[image.offset:image.end]):
            raise ValueError(f"request {rid}: image {i}'s span holds tokens other than the image "
                             f"placeholder {tokens.token_id}")
        previous_end = image.end
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


def computed_range(request: NewRequest) -> tuple[int, int]:
    """The prompt positions this prefill computes: from cache_len to its chunk's end."""
    end = (request.cache_len + request.chunk_len if request.is_partial_chunk
           else request.prompt_length)
    return request.cache_len, end
