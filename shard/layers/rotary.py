"""Rotary position embedding: cos/sin tables for every position.

With the checkpoints' frequency scalings (linear, Llama 3, Phi-3's LongRoPE) and partial
rotation (the first part of each head)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_SCALINGS = ("default", "linear", "llama3", "longrope")


def rope_type(scaling: dict | None) -> str:
    """The scaling's kind; Phi-3's first configs call LongRoPE "su"."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind


def inverse_frequencies(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The per-pair rotation frequencies of `dim` rotated dimensions.

    Adjusted by the checkpoint's rope scaling, if any (LongRoPE has two sets: position_angles)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq.float()
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(is_medium, smoothed, scaled).float()
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_SCALINGS)})")


def position_angles(dim: int, max_positions: int, theta: float, scaling: dict | None
                    ) -> tuple[torch.Tensor, float]:
    """Every position's angles [max_positions, dim / 2], and a factor scaling their cos and sin.

    The factor is LongRoPE's attention factor; 1 for the others."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if rope_type(scaling) != "longrope":
        return torch.outer(positions, inverse_frequencies(dim, theta, scaling)), 1.0
    missing = {"short_factor", "long_factor", "original_max_position_embeddings"} - set(scaling)
    if missing:
        raise ValueError(f"LongRoPE scaling without {', '.join(sorted(missing))}")
    original = int(scaling["original_max_position_embeddings"])
    # float32 throughout, as transformers computes them: these frequencies were fitted per pair
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    rescaled = {}
    for name in ("short_factor", "long_factor"):
        factors = torch.tensor(scaling[name], dtype=torch.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(f"rope scaling {name} has {factors.numel()} entries, not the "
                             f"{dim // 2} of the {dim} rotated dimensions of a head")
        rescaled[name] = 1.0 / (factors * powers)
    # Which factors rotate which position. transformers picks one set per forward (long for every
    # position once the sequence passes original_max_position_embeddings, short otherwise), so a
    # position's rotation depends on the sequence it is computed with: a key cached by a short
    # forward and read by a long one was rotated by the other set, and the same prompt would cache
    # other keys prefilled whole than in chunks or from a shared prefix. Here, as in vLLM, a
    # position's rotation is fixed: short factors below original_max_position_embeddings, long
    # ones from there on. Every cached key then stays valid (prefix cache, chunked prefill,
    # decode), and sequences within the original length, which are most, get exactly
    # transformers' rotations; a longer one mixes both sets where transformers, recomputing the
    # whole sequence, would use the long set everywhere.
    boundary = min(original, max_positions)
    angles = torch.cat([torch.outer(positions[:boundary], rescaled["short_factor"]),
                        torch.outer(positions[boundary:], rescaled["long_factor"])])
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:  # the LongRoPE paper's: sqrt(1 + log(s) / log(L_original))
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return angles, float(attention)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Where a model that rotates only the first `rotary_dim` dimensions of each head puts them.

    Checkpoints pair dimension i with i + rotary_dim / 2 and leave the rest unrotated; our
    rotation (apply_rotary, the C kernels) pairs i with i + head_dim / 2 over the whole head.
    Reordering each query and key head by this permutation (new dimension j holds checkpoint
    dimension order[j]) puts every rotated pair at (j, j + head_dim / 2), and the unrotated
    dimensions at pairs whose table entries are cos 1, sin 0 (RotaryEmbedding with rotary_dim):
    scores are unchanged, as queries and keys are permuted alike.
    """
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rotary_dim, rotary_dim + passed),
                      torch.arange(half, rotary_dim), torch.arange(rotary_dim + passed, head_dim)])


@dataclass(slots=True)
class RotaryAngles:
    """cos/sin of every new token's position, looked up once per forward and shared by all layers."""

    cos: torch.Tensor  # [T, 1, head_dim]: both halves of the head dimension
    sin: torch.Tensor  # [T, 1, head_dim]: the first half negated (see apply_rotary)


class RotaryEmbedding(nn.Module):
    """The rotary position embedding of a model's query and key heads.

    `rotary_dim` below head_dim: only that many dimensions of each head rotate, in the order of
    partial_rotary_order, which the model gives its query and key heads."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device, *, rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"{rotary_dim} rotary dimensions do not fit heads of {head_dim} "
                             "in pairs")
        angles, attention_factor = position_angles(rotary_dim, max_positions, theta, scaling)
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        if rotary_dim < head_dim:  # the unrotated pairs: x cos + (rolled x) sin = x
            passed = (head_dim - rotary_dim) // 2
            cos = torch.cat((cos, cos.new_ones(max_positions, passed)), -1)
            sin = torch.cat((sin, sin.new_zeros(max_positions, passed)), -1)
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
