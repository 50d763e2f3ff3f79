"""Qwen2.5-VL's vision tower, as transformers' Qwen2_5_VisionTransformerPretrainedModel computes it.

Each image's patches (shard.images.qwen2_vl: any number of rows and columns) are embedded by a
linear map (the checkpoint's 3-D convolution, whose stride is its kernel), rotated by a 2-D rotary
embedding of their row and column, and go through pre-norm blocks (RMS norm, attention, RMS norm,
a gated MLP). Most blocks attend within windows of window_size pixels, the fullatt_block_indexes
ones over the whole image; for the windowed ones the patches are reordered window by window,
and put back after the merger, which joins each merge x merge square of patches into one token.
Every rank holds all of it, as shard.models.siglip explains.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.models.siglip import _Linear
from shard.weights import Weights

# transformers' Qwen2_5_VLVisionConfig defaults, for the keys a config.json leaves out
_DEFAULTS = dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3,
                 out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                 window_size=112, fullatt_block_indexes=(7, 15, 23, 31), hidden_act="silu")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int  # pixels
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, cfg: dict) -> "VisionConfig":
        value = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        if value["hidden_act"] != "silu":
            raise ValueError(f"a Qwen2.5-VL vision tower with hidden_act {value['hidden_act']!r} "
                             "is not supported (supported: silu)")
        rope = value.get("rope_parameters") or {}
        value["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        value["fullatt_block_indexes"] = tuple(value["fullatt_block_indexes"])
        return cls(**{name: value[name] for name in cls.__slots__})

    @property
    def window_tokens(self) -> int:
        """The side of a window in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision on x [N, heads, head_dim], in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]
                    ) -> torch.Tensor:
    """Attention of q, k, v [N, heads, head_dim] within each segment bounds[i]..bounds[i + 1].

    Segments of one length are batched into one call."""
    out = torch.empty_like(q)
    by_length = defaultdict(list)
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            by_length[end - start].append(start)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)).to(q.device)
        attended = F.scaled_dot_product_attention(*(t[rows].transpose(1, 2) for t in (q, k, v)))
        out[rows] = attended.transpose(1, 2)
    return out


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig, weights: Weights, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.norm1 = _RMSNorm(weights.get(f"{prefix}.norm1.weight"), dtype)
        self.norm2 = _RMSNorm(weights.get(f"{prefix}.norm2.weight"), dtype)
        self.qkv = _Linear(weights, f"{prefix}.attn.qkv", dtype)
        self.proj = _Linear(weights, f"{prefix}.attn.proj", dtype)
        self.gate, self.up, self.down = (_Linear(weights, f"{prefix}.mlp.{name}", dtype)
                                         for name in ("gate_proj", "up_proj", "down_proj"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[int]) -> torch.Tensor:
        patches = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(patches, 3, self.num_heads, -1).unbind(1)
        attended = attend_segments(_rotate(q, cos, sin), _rotate(k, cos, sin), v, bounds)
        x = x + self.proj(attended.reshape(patches, -1))
        normed = self.norm2(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


class Qwen25VisionTower(nn.Module):
    """Images' patches [patches, patch values] -> their tokens [tokens, text hidden]."""

    def __init__(self, cfg: VisionConfig, weights: Weights, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        conv = weights.get(f"{prefix}patch_embed.proj.weight")
        self.patch_embed = nn.Parameter(conv.reshape(conv.shape[0], -1).to(dtype),
                                        requires_grad=False)
        self.blocks = nn.ModuleList(_Block(cfg, weights, f"{prefix}blocks.{i}", dtype)
                                    for i in range(cfg.depth))
        self.merger_norm = _RMSNorm(weights.get(f"{prefix}merger.ln_q.weight"), dtype)
        self.merger_in = _Linear(weights, f"{prefix}merger.mlp.0", dtype)
        self.merger_out = _Linear(weights, f"{prefix}merger.mlp.2", dtype)
        spatial = cfg.hidden_size // cfg.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float) / spatial)).to(weights.device),
            persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """`grids`: each image's (rows, columns) of merged tokens, in order."""
        unit = self.config.spatial_merge_size ** 2
        order, windows = _window_order(grids, self.config.window_tokens, unit)
        order = order.to(patches.device)
        x = F.linear(patches.to(self.dtype), self.patch_embed)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        angles = _patch_positions(grids, self.config.spatial_merge_size).to(x.device)
        freqs = (angles[..., None].float() * self.inv_freq).flatten(1)
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].flatten(0, 1)
        freqs = torch.cat((freqs, freqs), -1).unsqueeze(1)
        cos, sin = freqs.cos(), freqs.sin()
        images = [0]
        for rows, columns in grids:
            images.append(images[-1] + rows * columns * unit)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in self.config.fullatt_block_indexes else windows)
        merged = self.merger_norm(x).view(-1, unit * x.shape[-1])
        merged = self.merger_out(F.gelu(self.merger_in(merged)))
        return merged[torch.argsort(order)]


def _patch_positions(grids: list[tuple[int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [patches, 2], merge square by merge square."""
    out = []
    for rows, columns in grids:
        h, w = torch.meshgrid(torch.arange(rows * merge), torch.arange(columns * merge),
                              indexing="ij")
        shape = (rows, merge, columns, merge)
        out.append(torch.stack([h.reshape(shape).transpose(1, 2).flatten(),
                                w.reshape(shape).transpose(1, 2).flatten()], -1))
    return torch.cat(out)


def _window_order(grids: list[tuple[int, int]], side: int, unit: int
                  ) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens in window order (an index over them), and the windows' bounds in patches.

    Windows of `side` x `side` tokens from each image's top left; those at its right and bottom
    edges hold what is left."""
    order, bounds, first = [], [0], 0
    for rows, columns in grids:
        index = torch.arange(rows * columns).view(rows, columns)
        for top in range(0, rows, side):
            for left in range(0, columns, side):
                window = index[top:top + side, left:left + side].flatten()
                order.append(window + first)
                bounds.append(bounds[-1] + window.numel() * unit)
        first += rows * columns
    return torch.cat(order), bounds
