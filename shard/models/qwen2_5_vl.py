"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration), as transformers computes it.

The language model is Qwen2's (shard.models.llama, a bias on q/k/v) with multimodal rotary
positions (shard.models.mrope). An image goes through the vision tower
(shard.models.qwen2_5_vision) at its own resolution: its rows replace the embeddings of its
<|image_pad|> tokens, as many as its merged patch grid has cells, and attention stays causal.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from shard.images.qwen2_vl import Qwen2VLPreprocessor
from shard.images.tokens import ImageTokens
from shard.models.llama import LlamaConfig, LlamaForCausalLM
from shard.models.mrope import MRotaryEmbedding
from shard.models.qwen2_5_vision import Qwen25VisionTower, VisionConfig
from shard.partition import RankHeads
from shard.weights import Weights

__all__ = ["Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"]

log = logging.getLogger("tgi.shard.models")

# the Hub's files, and transformers 5's in-memory names
_TOWER_PREFIXES = ("visual.", "model.visual.")
# transformers' Qwen2_5_VLConfig defaults
_TOKEN_DEFAULTS = dict(image_token_id=151655, vision_start_token_id=151652,
                       vision_end_token_id=151653)


@dataclass(slots=True)
class Qwen2_5_VLConfig(LlamaConfig):
    mrope_section: tuple[int, ...] = (16, 24, 24)
    vision: dict = field(default_factory=dict)  # config.json's vision_config
    image_token_id: int = _TOKEN_DEFAULTS["image_token_id"]
    vision_start_token_id: int = _TOKEN_DEFAULTS["vision_start_token_id"]
    vision_end_token_id: int = _TOKEN_DEFAULTS["vision_end_token_id"]

    @classmethod
    def from_dict(cls, cfg: dict, **_) -> "Qwen2_5_VLConfig":
        """From a config.json: transformers 4's (text keys at the top) or 5's (a text_config)."""
        text = {**cfg, **(cfg.get("text_config") or {})}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise ValueError(f"Qwen2.5-VL with rope scaling {kind!r} is not supported")
        text.pop("rope_scaling", None)
        text["rope_parameters"] = {"rope_theta": rope.get("rope_theta",
                                                          text.get("rope_theta", 1000000.0))}
        base = LlamaConfig.from_dict(text, qkv_bias_default=True)
        tokens = {name: cfg.get(name, text.get(name, default))
                  for name, default in _TOKEN_DEFAULTS.items()}
        return cls(**{f.name: getattr(base, f.name) for f in fields(LlamaConfig)},
                   mrope_section=tuple(rope.get("mrope_section") or (16, 24, 24)),
                   vision=cfg.get("vision_config") or {}, **tokens)


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL's language model, and its vision tower where the checkpoint holds one."""

    ragged_images = True  # embed_images takes each image's patches and grid (their own sizes)

    def __init__(self, cfg: Qwen2_5_VLConfig, heads: RankHeads, weights: Weights):
        if not weights.has("model.embed_tokens.weight"):
            weights.read_prefix_as("model.language_model.", "model.")
        super().__init__(cfg, heads, weights)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                       list(cfg.mrope_section), weights.activation_dtype,
                                       weights.device)
        self.image_tokens: ImageTokens | None = None
        self.vision: Qwen25VisionTower | None = None
        prefix = next((p for p in _TOWER_PREFIXES if weights.has(f"{p}patch_embed.proj.weight")),
                      None)
        if prefix is None:
            log.warning("the checkpoint holds no vision tower: text only")
            return
        self.vision = Qwen25VisionTower(VisionConfig.from_dict(cfg.vision), weights, prefix,
                                        self.activation_dtype)
        # per_image 0: an image's tokens depend on its size (image_grid)
        self.image_tokens = ImageTokens(token_id=cfg.image_token_id, per_image=0,
                                        start_id=cfg.vision_start_token_id,
                                        end_id=cfg.vision_end_token_id, bidirectional=False)
        if cfg.image_token_id >= cfg.vocab_size:
            raise ValueError(f"image_token_id {cfg.image_token_id} lies past the vocabulary of "
                             f"{cfg.vocab_size}")

    def image_preprocessor(self, model_dir: Path) -> Qwen2VLPreprocessor:
        """Its images' preprocessing, as the checkpoint's preprocessor_config.json says."""
        tower = self.vision.config
        return Qwen2VLPreprocessor.for_model(model_dir, patch_size=tower.patch_size,
                                             merge_size=tower.spatial_merge_size,
                                             temporal_patch_size=tower.temporal_patch_size)

    def embed_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int]]
                     ) -> list[torch.Tensor]:
        """Each image's patches and (rows, columns) of tokens -> the rows of its tokens."""
        device = self.vision.patch_embed.device
        rows = self.vision(torch.cat(pixels).to(device), grids).to(self.activation_dtype)
        return list(rows.split([r * c for r, c in grids]))
