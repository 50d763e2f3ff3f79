"""The bytes of a request's images, from wherever the request says they are, each checked.

A data: URL everywhere; an http(s) URL, fetched unless the operator turned fetching off; a local
file (a file:// URL or an absolute path) only under --allowed-local-media-path; for SGLang,
plain base64 too. Every image is decoded once to check it (check.py); the count is bounded first.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from router.errors import ValidationError
from router.inputs.images.check import ImageSize, check_image
from router.inputs.images.fetch import fetch_image


class LocalDirectories(Protocol):
    """The directories local files may be read under (router.lifecycle.local_paths.LocalRoots)."""

    roots: tuple[Path, ...]

    def allows(self, path: str | Path) -> bool: ...


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What the operator lets a request's images be (tgi-router's image flags)."""

    max_images: int = 8  # per request
    fetch_remote: bool = True
    fetch_timeout: float = 10.0  # seconds, for the whole fetch of one image
    max_image_bytes: int = 20 * 2**20  # one image's file
    local_roots: LocalDirectories | None = None  # None: no local file is read
    # the only hosts images are fetched from (lower case); None: any with public addresses only
    allowed_hosts: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """One image, read and checked."""

    data: bytes  # the file as the client gave it
    digest: bytes  # its SHA-256: what the prefix cache keys its tokens' blocks on
    size: ImageSize


@dataclass(frozen=True, slots=True)
class ImageSource:
    """Where a request says one image is, and what its error messages call it."""

    where: str  # a data: or http(s) URL, a file:// URL or path, or (SGLang) plain base64
    what: str  # e.g. "messages[0].content[1].image_url"


async def load_images(sources: list[ImageSource], limits: MediaLimits, *,
                      bare_base64: bool = False) -> list[LoadedImage]:
    """Every image of a request, read and checked, in order; the first problem is a 422."""
    if len(sources) > limits.max_images:
        raise ValidationError(f"the request holds {len(sources)} images, more than the "
                              f"{limits.max_images} this server takes in one request "
                              "(--max-images-per-request)")
    loaded = await asyncio.gather(*(_load(s, limits, bare_base64) for s in sources),
                                  return_exceptions=True)
    for result in loaded:
        if isinstance(result, BaseException):
            raise result
    return list(loaded)


async def _load(source: ImageSource, limits: MediaLimits, bare_base64: bool) -> LoadedImage:
    data = await read_source(source, limits, bare_base64=bare_base64)
    size = await asyncio.to_thread(check_image, data, source.what)
    return LoadedImage(data, hashlib.sha256(data).digest(), size)


async def read_source(source: ImageSource, limits: MediaLimits, *,
                      bare_base64: bool = False) -> bytes:
    """The file bytes `source` names, unchecked."""
    where, what = source.where, source.what
    if not isinstance(where, str) or not where:
        raise ValidationError(f"{what} must be a non-empty string: a data: URL, an http(s) URL "
                              "or a file path")
    scheme = where.split(":", 1)[0].lower() if ":" in where[:10] else ""
    if scheme == "data":
        return _data_url(where, what, limits.max_image_bytes)
    if scheme in ("http", "https"):
        if not limits.fetch_remote:
            raise ValidationError(f"{what}: this server fetches no image URLs "
                                  "(--disable-image-fetch); send the image as a data: URL")
        return await fetch_image(where, what, timeout=limits.fetch_timeout,
                                 max_bytes=limits.max_image_bytes,
                                 allowed_hosts=limits.allowed_hosts)
    if scheme == "file" or where.startswith("/"):
        return await asyncio.to_thread(_local_file, where, what, limits)
    if bare_base64:
        return _base64(where, what, limits.max_image_bytes)
    raise ValidationError(f"{what} must be a data: URL (data:image/png;base64,...), an http(s) "
                          "URL or a file path")


def _data_url(url: str, what: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ValidationError(f"{what} is a data: URL without its ',': write "
                              "data:image/png;base64,<base64 of the file>")
    params = [p.strip().lower() for p in header.split(";")]
    kind = params[0]
    if kind and not kind.startswith("image/") and kind != "application/octet-stream":
        raise ValidationError(f"{what} is a data: URL of type {kind[:100]!r}, not an image "
                              "(image/*)")
    if "base64" in params[1:]:
        return _base64(payload, what, max_bytes)
    if len(payload) > 3 * max_bytes:  # percent-escaped: at most 3 characters a byte
        raise _too_large(what, max_bytes)
    data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(what, max_bytes)
    return data


def _base64(text: str, what: str, max_bytes: int) -> bytes:
    if len(text) > 4 * (max_bytes // 3 + 1) + 1024:  # bounded before decoding (line breaks too)
        raise _too_large(what, max_bytes)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(f"{what} is not valid base64") from None
    if len(data) > max_bytes:
        raise _too_large(what, max_bytes)
    return data


def _local_file(where: str, what: str, limits: MediaLimits) -> bytes:
    path = urllib.parse.unquote(urllib.parse.urlparse(where).path) if where.startswith(
        ("file:", "FILE:")) else where
    roots = limits.local_roots
    if roots is None or not roots.roots:
        raise ValidationError(f"{what}: this server reads no local files; its operator names "
                              "the directories it may read with --allowed-local-media-path")
    # one answer for a path outside, whether or not it exists: it says nothing of what lies there
    if not roots.allows(path):
        raise ValidationError(f"{what}: the path is not under --allowed-local-media-path")
    try:
        with Path(path).open("rb") as file:
            data = file.read(limits.max_image_bytes + 1)
    except OSError as err:
        raise ValidationError(f"{what}: the file could not be read ({err.strerror or err})"
                              ) from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(what, limits.max_image_bytes)
    return data


def _too_large(what: str, max_bytes: int) -> ValidationError:
    return ValidationError(f"{what} is larger than {max_bytes} bytes (--max-image-bytes)")
