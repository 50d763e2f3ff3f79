"""The vectors a prefill's tokens start from: token embeddings, given vectors, and images' rows.

Every image of the forward (across all its sequences) goes through the vision tower at once; its
rows replace the embeddings of its placeholder tokens. Where the model attends an image's tokens
both ways, the attention metadata learns each sequence's image spans.
"""
from __future__ import annotations

import torch

from shard.layers.attention_state import AttentionMetadata


def prefill_embeds(model: torch.nn.Module, seqs: list, device: torch.device) -> torch.Tensor:
    """The vectors of every sequence's tokens [T, hidden] (shard.model_runner.PrefillSequence).

    Given vectors are copied over their sequence's rows, images' rows (their `images`,
    shard.batch_state.PromptImage, preprocessed) over their tokens'."""
    ids = [t for s in seqs for t in (s.token_ids if s.embeds is None else [0] * s.length)]
    embeds = model.embed(torch.tensor(ids, dtype=torch.long, device=device))
    start = 0
    for s in seqs:
        if s.embeds is not None:
            embeds[start:start + s.length] = s.embeds.to(embeds.dtype)
        start += s.length
    images = list(_flat_images(seqs))
    if not images:
        return embeds
    pixels = [image.pixels for _, image in images]
    if getattr(model, "ragged_images", False):  # each image at its own size (Qwen2.5-VL)
        rows = model.embed_images(pixels, [image.grid for _, image in images])
    else:
        rows = model.embed_images(torch.stack(pixels).to(device))
    for (flat, image), image_rows in zip(images, rows):
        if image_rows.shape[0] != image.count:
            raise ValueError(f"an image gives {image_rows.shape[0]} rows, but spans "
                             f"{image.count} tokens")
        embeds[flat:flat + image.count] = image_rows.to(embeds.dtype)
    return embeds


def _flat_images(seqs: list):
    """(row of the forward its first token sits at, image) for every image of the sequences."""
    start = 0
    for s in seqs:
        for image in s.images:
            offset = image.offset - s.start
            if offset < 0 or offset + image.count > s.length:
                raise ValueError(f"an image at positions {image.offset}.."
                                 f"{image.offset + image.count - 1} lies outside the tokens "
                                 f"computed ({s.start}..{s.start + s.length - 1})")
            yield start + offset, image
        start += s.length


def mark_image_spans(model: torch.nn.Module, meta: AttentionMetadata, seqs: list) -> None:
    """The image spans of each sequence, where the model attends an image's tokens both ways.

    Their sequences' attention runs in PyTorch with a mask (the C kernel reads causally only)."""
    tokens = getattr(model, "image_tokens", None)
    if tokens is None or not tokens.bidirectional or not any(s.images for s in seqs):
        return
    layout = meta.prefill
    layout.image_spans = [[(image.offset, image.offset + image.count) for image in s.images]
                          for s in seqs]
    if layout.kernel_sequences is not None:
        layout.kernel_sequences = [short and not s.images
                                   for short, s in zip(layout.kernel_sequences, seqs)]
