"""Gemma 3 with its vision tower (Gemma3ForConditionalGeneration), as transformers computes it.

The language model is Gemma 3's (shard.models.gemma). An image goes through the SigLIP tower
(shard.models.siglip) and the multi-modal projector: the patch states average-pooled to
mm_tokens_per_image (a square grid), RMS-normed (1 + weight, as Gemma's norms) and projected to the
text's hidden size. Those rows replace the embeddings of the image's placeholder tokens, unscaled,
and within each image the tokens attend to one another both ways (ImageTokens.bidirectional).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shard.images.gemma3 import Gemma3Preprocessor
from shard.images.tokens import ImageTokens
from shard.models.gemma import GemmaConfig, GemmaForCausalLM, GemmaRMSNorm
from shard.models.siglip import SiglipConfig, SiglipVisionTower, tower_prefix
from shard.partition import RankHeads
from shard.weights import Weights

__all__ = ["Gemma3ForConditionalGeneration", "GemmaConfig", "ImageTokens"]

log = logging.getLogger("tgi.shard.models")

# where checkpoints keep the tower: the Hub's files, transformers 4's in-memory names, and
# transformers 5's (which drop `vision_model.`)
_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
                   "vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# transformers' Gemma3Config defaults
_MM_DEFAULTS = dict(mm_tokens_per_image=256, image_token_index=262144, boi_token_index=255999,
                    eoi_token_index=256000)


class Gemma3Projector(nn.Module):
    """Patch states [images, patches, vision hidden] -> [images, tokens, text hidden]."""

    def __init__(self, tower: SiglipConfig, tokens_per_image: int, weights: Weights,
                 prefix: str, dtype: torch.dtype):
        super().__init__()
        side = round(tokens_per_image ** 0.5)
        if side * side != tokens_per_image or tower.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} is not a square grid that "
                             f"pools the tower's {tower.patches_per_side}x"
                             f"{tower.patches_per_side} patches evenly")
        self.patches_per_side = tower.patches_per_side
        self.kernel = tower.patches_per_side // side
        self.norm = GemmaRMSNorm(weights.get(f"{prefix}mm_soft_emb_norm.weight"),
                                 tower.layer_norm_eps)
        self.projection = nn.Parameter(
            weights.get(f"{prefix}mm_input_projection_weight").to(dtype), requires_grad=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        images, _, width = states.shape
        grid = states.transpose(1, 2).reshape(images, width, self.patches_per_side,
                                              self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.norm(pooled.reshape(-1, width)).view(pooled.shape)
        return torch.matmul(normed, self.projection)


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3's language model, and its vision tower where the checkpoint holds one.

    Without one (a checkpoint stripped to its language model), it serves text alone:
    image_tokens is then None."""

    def __init__(self, cfg: GemmaConfig, heads: RankHeads, weights: Weights):
        super().__init__(cfg, heads, weights)
        multimodal = {**_MM_DEFAULTS, **{k: v for k, v in (cfg.multimodal or {}).items()
                                         if v is not None}}
        self.image_tokens: ImageTokens | None = None
        self.vision: SiglipVisionTower | None = None
        self.projector: Gemma3Projector | None = None
        prefix = tower_prefix(weights, _TOWER_PREFIXES)
        projector = next((p for p in _PROJECTOR_PREFIXES
                          if weights.has(f"{p}mm_input_projection_weight")), None)
        if prefix is None or projector is None:
            log.warning("the checkpoint holds no vision tower or projector: text only")
            return
        tower = SiglipConfig.from_dict(multimodal.get("vision_config") or {})
        dtype = self.activation_dtype
        self.vision = SiglipVisionTower(tower, weights, prefix, dtype)
        self.projector = Gemma3Projector(tower, multimodal["mm_tokens_per_image"], weights,
                                         projector, dtype)
        self.image_tokens = ImageTokens(
            token_id=multimodal["image_token_index"], per_image=multimodal["mm_tokens_per_image"],
            start_id=multimodal["boi_token_index"], end_id=multimodal["eoi_token_index"],
            bidirectional=True)
        if self.image_tokens.token_id >= cfg.vocab_size:
            # transformers looks such a placeholder up as id 0; its rows are replaced anyway
            raise ValueError(f"image_token_index {self.image_tokens.token_id} lies past the "
                             f"vocabulary of {cfg.vocab_size}")

    @property
    def image_side(self) -> int:
        """Pixels of the square the tower reads."""
        return self.vision.config.image_size

    def image_preprocessor(self, model_dir: Path) -> Gemma3Preprocessor:
        """Its images' preprocessing, as the checkpoint's preprocessor_config.json says."""
        return Gemma3Preprocessor.for_model(model_dir, self.image_side)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixel values [images, 3, side, side] -> the rows of their tokens [images, tokens, hidden]."""
        return self.projector(self.vision(pixels)).to(self.activation_dtype)
