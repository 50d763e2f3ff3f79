"""An image file's bytes -> a decoded RGB picture, by Pillow, or a ValueError saying what is wrong."""
from __future__ import annotations

import io
import warnings

from PIL import Image

# Pillow's own bomb limit (about 89 megapixels): a file that claims more pixels is refused before
# its pixels are allocated, whatever its size on disk
MAX_PIXELS = Image.MAX_IMAGE_PIXELS


def decode_rgb(data: bytes) -> Image.Image:
    """The picture in `data`, fully decoded, as RGB with transparency over white.

    As transformers' convert_to_rgb does: an image with an alpha band or a transparent colour is
    composited onto a white background, any other mode converted."""
    if not data:
        raise ValueError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_PIXELS and twice that: refuse the whole range
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()  # a truncated file fails here, not later inside the forward
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError(f"the image's dimensions exceed {MAX_PIXELS} pixels "
                         "(a decompression bomb)") from None
    except Image.UnidentifiedImageError:
        raise ValueError("the data is not an image Pillow can read") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"the image could not be decoded (truncated or corrupt): {err}") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")
