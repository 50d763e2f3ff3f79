"""What a prefill forward computes of each request: its tokens, their positions and its images."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.batch_state import NewRequest, PromptImage
from shard.images.admission import computed_range
from shard.models.mrope import mrope_positions


@dataclass(slots=True)
class PrefillSequence:
    token_ids: list[int]  # the tokens to compute now
    start: int  # tokens of this sequence already in the cache (position of token_ids[0])
    blocks: list[int]
    embeds: torch.Tensor | None = None  # [n, hidden]: given vectors in place of token_ids
    adapter_slot: int = -1  # the LoRA adapter of every token (-1: none)
    images: list[PromptImage] = field(default_factory=list)  # preprocessed, over token_ids
    # [3, n] multimodal rotary positions (shard.models.mrope); None: start, start + 1, ...
    rope_positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids) if self.embeds is None else self.embeds.shape[0]


def sequence_of(request: NewRequest) -> PrefillSequence:
    """What the forward computes of a request: the rest of its prompt, or its next chunk."""
    start, end = computed_range(request)
    if request.input_embeds is not None:
        return PrefillSequence([], request.cache_len, request.blocks,
                               request.input_embeds[request.cache_len:end],
                               adapter_slot=request.adapter_slot)
    # the images before cache_len are in the cached keys and values already; their grids still
    # place the tokens after them
    images = [image for image in request.images if start <= image.offset < end]
    positions = (mrope_positions(request.images, start, end)
                 if any(image.grid is not None for image in request.images) else None)
    return PrefillSequence(request.input_ids[start:end], start, request.blocks,
                           adapter_slot=request.adapter_slot, images=images,
                           rope_positions=positions)


def forward_positions(seqs: list[PrefillSequence], positions: torch.Tensor) -> torch.Tensor:
    """The positions the model rotates the sequences' tokens by.

    `positions` [T] (their indices), or [3, T] where a sequence has multimodal ones (the others'
    indices repeated)."""
    if all(s.rope_positions is None for s in seqs):
        return positions
    rows, cursor = [], 0
    for s in seqs:
        own = positions[cursor:cursor + s.length]
        rows.append(own.expand(3, -1) if s.rope_positions is None
                    else s.rope_positions.to(positions.device))
        cursor += s.length
    return torch.cat(rows, 1)


def with_riding_rows(positions: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """A riding batch's positions [B] put before a prefill's ([T] or [3, T])."""
    return torch.cat([decode if positions.dim() == 1 else decode.expand(3, -1), positions], -1)
