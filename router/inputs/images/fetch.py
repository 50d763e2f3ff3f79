"""An image's bytes from an http(s) URL, within the operator's bounds on time, size and redirects.

The whole fetch (connecting, redirects and the body) gets one deadline; the body is read no further
than the size bound, whatever Content-Length says; only an image/* answer is taken.
"""
from __future__ import annotations

import asyncio

import aiohttp

from router.errors import ValidationError

MAX_REDIRECTS = 5  # as browsers bound a chain, far below a loop's


async def fetch_image(url: str, what: str, *, timeout: float, max_bytes: int) -> bytes:
    """The body of `url`, an image; a ValidationError naming `what` and the problem otherwise."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url, max_redirects=MAX_REDIRECTS) as answer:
                if answer.status != 200:
                    raise ValidationError(f"{what}: fetching {_short(url)} answered HTTP "
                                          f"{answer.status}")
                kind = answer.content_type
                if not kind.startswith("image/"):
                    raise ValidationError(f"{what}: {_short(url)} answered content type "
                                          f"{kind!r}, not an image (image/*)")
                if answer.content_length is not None and answer.content_length > max_bytes:
                    raise _too_large(what, url, max_bytes)
                data = bytearray()
                async for piece in answer.content.iter_chunked(65536):
                    data += piece
                    if len(data) > max_bytes:
                        raise _too_large(what, url, max_bytes)
                return bytes(data)
    except aiohttp.TooManyRedirects:
        raise ValidationError(f"{what}: {_short(url)} redirects more than {MAX_REDIRECTS} "
                              "times") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise ValidationError(f"{what}: {_short(url)} did not answer within {timeout:g} s "
                              "(--image-fetch-timeout)") from None
    except (aiohttp.ClientError, OSError, ValueError) as err:
        raise ValidationError(f"{what}: {_short(url)} could not be fetched "
                              f"({type(err).__name__}: {str(err)[:200]})") from None


def _too_large(what: str, url: str, max_bytes: int) -> ValidationError:
    return ValidationError(f"{what}: {_short(url)} is larger than {max_bytes} bytes "
                           "(--max-image-bytes)")


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."
