"""Rotary position embedding: cos/sin tables for every position, with Llama's frequency scalings."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The per-pair rotation frequencies, adjusted by the checkpoint's rope scaling, if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).float()
    if rope_type == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(is_medium, smoothed, scaled).float()
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, "
                     "llama3)")


@dataclass(slots=True)
class RotaryAngles:
    """cos/sin of every new token's position, looked up once per forward and shared by all layers."""

    cos: torch.Tensor  # [T, 1, head_dim]: both halves of the head dimension
    sin: torch.Tensor  # [T, 1, head_dim]: the first half negated (see apply_rotary)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        # [max_positions, head_dim]
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(device=device, dtype=dtype),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> RotaryAngles:
        return RotaryAngles(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


def apply_rotary(x: torch.Tensor, angles: RotaryAngles) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] (queries and keys together: the same rotation applies to both).

    Hugging Face layout: the two halves of the head dimension are the (real, imaginary) parts, so
    the result is (x1 cos - x2 sin, x2 cos + x1 sin). Rolling x by half a head gives (x2, x1), and the
    sign sits in the table: three ops instead of eight, for the few-microsecond ops of a decode step.
    """
    return torch.addcmul(x * angles.cos, x.roll(x.shape[-1] // 2, -1), angles.sin)
