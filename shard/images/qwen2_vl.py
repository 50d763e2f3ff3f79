"""Qwen2-VL's and Qwen2.5-VL's image preprocessing, as transformers' Qwen2VLImageProcessor does it.

Dynamic resolution: each image is resized (Pillow's bicubic filter) to the sides smart_resize
picks, multiples of patch * merge pixels whose product lies within min and max pixels, keeping
the aspect ratio; rescaled, normalised (CLIP's mean and std by default) and cut into patches,
each flattened with the frame repeated temporal_patch_size times (a still image is a video of one
frame), in the order the vision tower's patch merger reads them.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shard.images.decode import decode_rgb

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' smart_resize: the (height, width) an image of this size is resized to."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio ({width}x{height}) is beyond 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class Qwen2VLPreprocessor:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_config(cls, cfg: dict, *, patch_size: int, merge_size: int,
                    temporal_patch_size: int) -> "Qwen2VLPreprocessor":
        """A preprocessor_config.json's settings (transformers 4's min/max_pixels or 5's size).

        The patch geometry must be the vision tower's: a ValueError says where it is not."""
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        for name, tower in (("patch_size", patch_size), ("merge_size", merge_size),
                            ("temporal_patch_size", temporal_patch_size)):
            if cfg.get(name, tower) != tower:
                raise ValueError(f"preprocessor_config.json's {name} {cfg[name]} is not the "
                                 f"vision tower's {tower}")
        if cfg.get("do_resize") is False or cfg.get("do_rescale") is False or cfg.get(
                "do_normalize") is False:
            raise ValueError("a Qwen2-VL preprocessor that skips resizing, rescaling or "
                             "normalising is not supported")
        return cls(patch_size, merge_size, temporal_patch_size, int(min_pixels), int(max_pixels),
                   tuple(cfg.get("image_mean") or CLIP_MEAN),
                   tuple(cfg.get("image_std") or CLIP_STD),
                   float(cfg.get("rescale_factor") or 1 / 255),
                   int(cfg.get("resample", Image.Resampling.BICUBIC)))

    @classmethod
    def for_model(cls, model_dir: Path, **tower) -> "Qwen2VLPreprocessor":
        """The checkpoint's preprocessor_config.json (transformers' defaults without one)."""
        path = Path(model_dir) / "preprocessor_config.json"
        return cls.from_config(json.loads(path.read_text()) if path.is_file() else {}, **tower)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) in pixels of an image of this size once resized."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels,
                            self.max_pixels)

    def grid(self, data: bytes) -> tuple[int, int]:
        """(rows, columns) of the image's tokens, from its header alone (its pixels unread)."""
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (OSError, ValueError, SyntaxError) as err:
            raise ValueError(f"the data is not an image Pillow can read ({err})") from None
        unit = self.patch_size * self.merge_size
        resized_height, resized_width = self.resized(width, height)
        return resized_height // unit, resized_width // unit

    def __call__(self, data: bytes) -> torch.Tensor:
        """An image file -> its patches [rows * columns * merge**2, 3 * temporal * patch**2]."""
        image = decode_rgb(data)
        height, width = self.resized(*image.size)
        image = image.resize((width, height), resample=self.resample)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        pixels = (pixels * self.rescale - mean) / std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, columns = height // p, width // p
        patches = pixels.reshape(3, rows // m, m, p, columns // m, m, p)
        patches = patches.permute(1, 4, 2, 5, 0, 3, 6)  # merge squares, then channel and frame
        patches = patches.unsqueeze(5).expand(*patches.shape[:5], t, p, p)
        return patches.reshape(rows * columns, 3 * t * p * p).contiguous()
