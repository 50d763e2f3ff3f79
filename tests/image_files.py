"""Image files for the image tests, made with Pillow: good ones, and the kinds a server refuses."""
from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def image_bytes(width: int = 8, height: int = 6, *, fmt: str = "PNG",
                color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def truncated_png() -> bytes:
    """A PNG whose pixel data stops half way (its header is whole)."""
    data = image_bytes(64, 64, color=(1, 2, 3))
    return data[:len(data) // 2]


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A small PNG whose header claims `width` x `height` pixels (a decompression bomb)."""
    data = bytearray(image_bytes(4, 4))
    # IHDR is the first chunk: 8-byte signature, length, "IHDR", then width and height
    header = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(header) & 0xFFFFFFFF)
    return bytes(data)
