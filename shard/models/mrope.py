"""Multimodal rotary positions (M-RoPE), as Qwen2-VL and Qwen2.5-VL place a prompt's tokens.

Each token has three positions (time, row, column). A text token's three are equal; an image's
tokens share the time of its first, and add their row and column within the image to it. The
text after an image goes on from the image's largest position plus one, so a prompt's positions
fall behind its length by its rope delta: the sum over its images of (their tokens minus the
larger of their rows and columns). Decoding goes on at length plus delta, one position for all
three. The head's rotated pairs are split in mrope_section parts, which read the time, row and
column positions in turn.
"""
from __future__ import annotations

import torch

from shard.layers.rotary import RotaryAngles, RotaryEmbedding


def rope_delta(images: list) -> int:
    """What a prompt's positions fall behind its length, from its images' token grids.

    `images`: shard.batch_state.PromptImage, with `grid` (rows, columns) set; 0 without."""
    return sum(max(image.grid) - image.count for image in images if image.grid is not None)


def mrope_positions(images: list, start: int, end: int) -> torch.Tensor:
    """The [3, end - start] positions of prompt tokens start..end - 1.

    Every image of the prompt is given (those before `start` shift the positions after them)."""
    pieces, cursor, delta = [], 0, 0
    for image in images:
        if image.offset >= end:
            break
        pieces.append((torch.arange(cursor, image.offset) + delta).expand(3, -1))
        rows, columns = image.grid
        first = image.offset + delta
        pieces.append(torch.stack([torch.full((rows * columns,), first),
                                   first + torch.arange(rows).repeat_interleave(columns),
                                   first + torch.arange(columns).repeat(rows)]))
        delta += max(rows, columns) - rows * columns
        cursor = image.end
    pieces.append((torch.arange(cursor, max(cursor, end)) + delta).expand(3, -1))
    return torch.cat(pieces, 1)[:, start:end]


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary angles for positions [T] (text: Llama's tables) or [3, T] (M-RoPE).

    `sections`: the rotated pairs read from the time, row and column positions, in turn."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, sections: list[int],
                 dtype: torch.dtype, device: torch.device):
        super().__init__(head_dim, max_positions, theta, None, dtype, device)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} does not split the {head_dim // 2} "
                             "rotated pairs of a head")
        which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
        self.register_buffer("which", torch.cat((which, which)).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> RotaryAngles:
        if positions.dim() == 1:
            return super().forward(positions)
        index = self.which.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index).squeeze(0)
        sin = self.sin[positions].gather(0, index).squeeze(0)
        return RotaryAngles(cos.unsqueeze(1), sin.unsqueeze(1))
