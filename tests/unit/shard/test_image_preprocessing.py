"""Gemma 3's image preprocessing against transformers' processor, and files Pillow cannot decode.

The pictures are made with Pillow in PNG, JPEG and WebP, in several sizes and aspect ratios and in
the modes a client sends (RGB, RGBA, grayscale, a palette with a transparent colour).
"""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from shard.images.decode import MAX_PIXELS, decode_rgb
from shard.images.gemma3 import Gemma3Preprocessor

SIDE = 896  # Gemma 3's default
# each kind takes two, in turn: every size is met in several formats
SIZES = [(896, 896), (640, 360), (200, 700), (37, 23), (1000, 64)]
KINDS = [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("PNG", "P"), ("JPEG", "RGB"),
         ("JPEG", "L"), ("WEBP", "RGB"), ("WEBP", "RGBA")]


def _picture(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = 4 if mode == "RGBA" else 3
    values = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    picture = Image.fromarray(values, "RGBA" if bands == 4 else "RGB")
    return picture if mode in ("RGB", "RGBA") else picture.convert(mode)


def _file(picture: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    extra = {"transparency": 7} if picture.mode == "P" else {}
    picture.save(out, fmt, **extra)
    return out.getvalue()


@pytest.fixture(scope="module")
def processors():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    # the Hub's Gemma 3 preprocessor_config.json: 896 pixels, mean and std 0.5, bilinear
    reference = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2)
    ours = Gemma3Preprocessor(SIDE, (0.5,) * 3, (0.5,) * 3, 1 / 255, Image.Resampling.BILINEAR)
    return reference, ours


@pytest.mark.parametrize("fmt,mode", KINDS, ids=[f"{f}-{m}" for f, m in KINDS])
def test_pixel_values_match_transformers(processors, fmt, mode):
    reference, ours = processors
    turn = KINDS.index((fmt, mode))
    for seed, (width, height) in enumerate([SIZES[turn % 5], SIZES[(turn + 2) % 5]]):
        data = _file(_picture(width, height, mode, seed), fmt)
        expected = reference(Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"][0]
        got = ours(data)
        assert got.shape == expected.shape == (3, SIDE, SIDE)
        assert got.dtype == torch.float32
        assert (got - expected).abs().max().item() <= 1e-5, (width, height)


def test_transparency_is_composited_over_white():
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert decode_rgb(_file(clear, "PNG")).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("data,reason", [
    (b"", "empty"),
    (b"GIF89a? no, just text", "not an image"),
    (_file(_picture(200, 200, "RGB", 0), "PNG")[:300], "truncated"),
    (_file(_picture(200, 200, "RGB", 0), "JPEG")[:500], "truncated"),
], ids=["empty", "not-an-image", "truncated-png", "truncated-jpeg"])
def test_undecodable_files_say_why(data, reason):
    with pytest.raises(ValueError, match=reason):
        decode_rgb(data)


def test_a_decompression_bomb_is_refused_before_its_pixels_are_allocated():
    """A 1-bit PNG that claims more pixels than MAX_PIXELS: a few kilobytes on the wire."""
    side = int(MAX_PIXELS ** 0.5) + 100
    out = io.BytesIO()
    Image.new("1", (side, side)).save(out, "PNG")
    assert len(out.getvalue()) < 2_000_000
    with pytest.raises(ValueError, match="decompression bomb"):
        decode_rgb(out.getvalue())
