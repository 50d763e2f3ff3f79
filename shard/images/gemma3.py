"""Gemma 3's image preprocessing, as transformers' Gemma3ImageProcessor computes it.

Each image decoded (shard.images.decode), resized to the tower's square side with Pillow's
bilinear filter, rescaled to [0, 1] and normalised by mean and std (0.5 each by default). Pan and
scan (extra crops of wide images) is off by default, and off here: the router's placeholder
tokens count one image per image.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shard.images.decode import decode_rgb

log = logging.getLogger("tgi.shard.images")


@dataclass(frozen=True, slots=True)
class Gemma3Preprocessor:
    side: int  # pixels of the square the tower reads
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float
    resample: int  # a Pillow filter (preprocessor_config.json's `resample`)

    @classmethod
    def for_model(cls, model_dir: Path, tower_side: int) -> "Gemma3Preprocessor":
        """The checkpoint's preprocessor_config.json, read as transformers reads it.

        Without one, the defaults at the tower's side. A size other than the tower's would give
        patches the position embeddings do not cover: a ValueError says so."""
        path = Path(model_dir) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        size = cfg.get("size") or {"height": tower_side, "width": tower_side}
        if (size.get("height"), size.get("width")) != (tower_side, tower_side):
            raise ValueError(f"preprocessor_config.json resizes images to {size}, but the vision "
                             f"tower reads {tower_side}x{tower_side} pixels")
        if cfg.get("do_pan_and_scan"):
            log.warning("preprocessor_config.json asks for pan and scan: images are served "
                        "whole, without its extra crops")
        if cfg.get("do_resize") is False or cfg.get("do_rescale") is False or cfg.get(
                "do_normalize") is False:
            raise ValueError("a Gemma 3 preprocessor that skips resizing, rescaling or "
                             "normalising is not supported")
        mean, std = cfg.get("image_mean") or 0.5, cfg.get("image_std") or 0.5
        return cls(side=tower_side, mean=_three(mean), std=_three(std),
                   rescale=float(cfg.get("rescale_factor") or 1 / 255),
                   resample=int(cfg.get("resample", Image.Resampling.BILINEAR)))

    def __call__(self, data: bytes) -> torch.Tensor:
        """An image file -> pixel values [3, side, side], float32."""
        image = decode_rgb(data).resize((self.side, self.side), resample=self.resample)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)
        pixels = pixels * self.rescale
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        return ((pixels - mean) / std).contiguous()


def _three(value) -> tuple[float, float, float]:
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * 3
    if len(values) != 3:
        raise ValueError(f"an image mean or std must have 3 channels, not {value}")
    return tuple(values)
