"""SigLIP's vision encoder, as transformers' modeling_siglip.py computes it (no pooling head).

Patches embedded by a strided convolution plus a learned position per patch, pre-norm encoder
layers (LayerNorm, attention over every patch of the image, a gelu(tanh) MLP) and a final
LayerNorm. Every rank holds all of it: the tower is small beside the language model, and its
output must be whole on each rank, which replicating it gives without collectives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.weights import Weights

# transformers' SiglipVisionConfig defaults, for the keys a config.json leaves out
_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                 layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int  # the square side, in pixels, the tower was trained on
    patch_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, cfg: dict) -> "SiglipConfig":
        value = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        if value["hidden_act"] != "gelu_pytorch_tanh":
            raise ValueError(f"a SigLIP tower with hidden_act {value['hidden_act']!r} is not "
                             "supported (supported: gelu_pytorch_tanh)")
        if value["image_size"] % value["patch_size"]:
            raise ValueError(f"image_size {value['image_size']} is not a whole number of "
                             f"{value['patch_size']}-pixel patches")
        return cls(**{name: value[name] for name in cls.__slots__})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _Linear(nn.Module):
    """A dense layer with its bias, whole on every rank."""

    def __init__(self, weights: Weights, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weights.get(f"{prefix}.weight").to(dtype), requires_grad=False)
        self.bias = nn.Parameter(weights.get(f"{prefix}.bias").to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, weights: Weights, prefix: str, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weights.get(f"{prefix}.weight").to(dtype), requires_grad=False)
        self.bias = nn.Parameter(weights.get(f"{prefix}.bias").to(dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig, weights: Weights, prefix: str, dtype: torch.dtype):
        super().__init__()
        eps = cfg.layer_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.layer_norm1 = _LayerNorm(weights, f"{prefix}.layer_norm1", eps, dtype)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            _Linear(weights, f"{prefix}.self_attn.{name}", dtype)
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"))
        self.layer_norm2 = _LayerNorm(weights, f"{prefix}.layer_norm2", eps, dtype)
        self.fc1 = _Linear(weights, f"{prefix}.mlp.fc1", dtype)
        self.fc2 = _Linear(weights, f"{prefix}.mlp.fc2", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, width = x.shape
        normed = self.layer_norm1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(images, patches, self.num_heads, -1).transpose(1, 2)

        # every patch sees every patch of its own image: no mask (SDPA scales by head_dim**-0.5)
        attended = F.scaled_dot_product_attention(heads(self.q_proj(normed)),
                                                  heads(self.k_proj(normed)),
                                                  heads(self.v_proj(normed)))
        x = x + self.out_proj(attended.transpose(1, 2).reshape(images, patches, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    """pixel values [images, channels, side, side] -> patch states [images, patches, hidden]."""

    def __init__(self, cfg: SiglipConfig, weights: Weights, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.patch_weight = nn.Parameter(
            weights.get(f"{prefix}embeddings.patch_embedding.weight").to(dtype),
            requires_grad=False)
        self.patch_bias = nn.Parameter(
            weights.get(f"{prefix}embeddings.patch_embedding.bias").to(dtype), requires_grad=False)
        self.positions = nn.Parameter(
            weights.get(f"{prefix}embeddings.position_embedding.weight").to(dtype),
            requires_grad=False)
        self.layers = nn.ModuleList(
            _EncoderLayer(cfg, weights, f"{prefix}encoder.layers.{i}", dtype)
            for i in range(cfg.num_hidden_layers))
        self.post_layernorm = _LayerNorm(weights, f"{prefix}post_layernorm", cfg.layer_norm_eps,
                                         dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.conv2d(pixels.to(self.dtype), self.patch_weight, self.patch_bias,
                           stride=self.config.patch_size)
        x = patches.flatten(2).transpose(1, 2) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def tower_prefix(weights: Weights, candidates: tuple[str, ...]) -> str | None:
    """The first of `candidates` under which the checkpoint holds a SigLIP tower, or None."""
    return next((prefix for prefix in candidates
                 if weights.has(f"{prefix}embeddings.patch_embedding.weight")), None)
