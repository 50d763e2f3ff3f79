"""Qwen2.5-VL's image preprocessing against transformers' Qwen2VLImageProcessor (its Pillow one).

Dynamic resolution: sizes that smart_resize keeps, shrinks below max_pixels and grows above
min_pixels, in several aspect ratios, each in PNG, JPEG and WebP and the modes a client sends.
"""
import io

import pytest
import torch
from PIL import Image

from shard.images.qwen2_vl import Qwen2VLPreprocessor, smart_resize
from tests.unit.shard.test_image_preprocessing import KINDS, _file, _picture

# transformers' defaults but max_pixels (a quarter of its 1280 tokens, for a quick test)
SETTINGS = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                max_pixels=28 * 28 * 320)
# kept (448x448), shrunk (1000x800, 640x360 past max_pixels), grown (20x30 below min_pixels),
# tall and wide ones
SIZES = [(448, 448), (1000, 800), (640, 360), (20, 30), (90, 700), (1000, 64)]


@pytest.fixture(scope="module")
def processors():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    ours = Qwen2VLPreprocessor.from_config(SETTINGS, patch_size=14, merge_size=2,
                                           temporal_patch_size=2)
    return Qwen2VLImageProcessorPil(**SETTINGS), ours


@pytest.mark.parametrize("fmt,mode", KINDS, ids=[f"{f}-{m}" for f, m in KINDS])
def test_patches_match_transformers(processors, fmt, mode):
    reference, ours = processors
    turn = KINDS.index((fmt, mode))
    for seed, (width, height) in enumerate([SIZES[turn % 6], SIZES[(turn + 3) % 6]]):
        data = _file(_picture(width, height, mode, seed), fmt)
        expected = reference(Image.open(io.BytesIO(data)), return_tensors="pt")
        got = ours(data)
        _, rows, columns = expected["image_grid_thw"][0].tolist()
        assert ours.grid(data) == (rows // 2, columns // 2)
        assert got.dtype == torch.float32
        assert got.shape == expected["pixel_values"].shape == (rows * columns, 3 * 2 * 14 * 14)
        assert (got - expected["pixel_values"]).abs().max().item() <= 1e-5, (width, height)


def test_the_checkpoints_settings_are_read_in_either_form(tmp_path):
    """transformers 4's min_pixels/max_pixels, 5's size; another patch size than the tower's is
    refused."""
    old = Qwen2VLPreprocessor.from_config({"min_pixels": 100, "max_pixels": 5000},
                                          patch_size=14, merge_size=2, temporal_patch_size=2)
    new = Qwen2VLPreprocessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 5000}},
                                          patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (old.min_pixels, old.max_pixels) == (new.min_pixels, new.max_pixels) == (100, 5000)
    with pytest.raises(ValueError, match="patch_size 16"):
        Qwen2VLPreprocessor.from_config({"patch_size": 16}, patch_size=14, merge_size=2,
                                        temporal_patch_size=2)
    assert smart_resize(30, 20, 28, 56 * 56, 10**6) == (84, 56)
    with pytest.raises(ValueError, match="200:1"):
        smart_resize(1, 300, 28, 56 * 56, 10**6)
