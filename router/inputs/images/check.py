"""One image's bytes decoded once with Pillow: a 422 naming what is wrong, before any shard sees it.

The header's dimensions are compared with the pixel bound before a pixel is decoded, so a small
file claiming huge dimensions (a decompression bomb) costs nothing; then every pixel is decoded,
so a truncated or corrupt file is found here.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from router.errors import ValidationError

# Pillow's own bound (about 89 megapixels): larger is refused as a decompression bomb
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@dataclass(frozen=True, slots=True)
class ImageSize:
    format: str  # Pillow's name of the file's format (PNG, JPEG, WEBP, ...)
    width: int
    height: int


def check_image(data: bytes, what: str, *, max_pixels: int = MAX_PIXELS) -> ImageSize:
    """The size of the image in `data`; a ValidationError naming `what` when it is none.

    `what` names the image in the request (its field or part).
    """
    if not data:
        raise ValidationError(f"{what} is empty (0 bytes): not an image")
    try:
        with warnings.catch_warnings():
            # past MAX_IMAGE_PIXELS Pillow warns, past twice that it raises: both are refused
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise _bomb(what, f"{width}x{height} pixels", max_pixels)
                image.load()
                return ImageSize(image.format or "", width, height)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _bomb(what, str(err), max_pixels) from None
    except UnidentifiedImageError:
        raise ValidationError(f"{what} is not an image (PNG, JPEG, WebP, GIF, ... that Pillow "
                              "reads)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as err:
        raise ValidationError(f"{what} is not a readable image (truncated or corrupt: "
                              f"{err})") from None


def _bomb(what: str, detail: str, max_pixels: int) -> ValidationError:
    return ValidationError(f"{what} is refused as a decompression bomb ({detail}; at most "
                           f"{max_pixels} pixels are read)")
