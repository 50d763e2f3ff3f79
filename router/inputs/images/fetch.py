"""An image's bytes from an http(s) URL, within the operator's bounds on time, size and hosts.

The whole fetch (connecting, redirects and the body) gets one deadline; the body is read no further
than the size bound, whatever Content-Length says; only an image/* answer is taken. Redirects are
followed here, one at a time, so that each hop is checked as the first URL is: a request may make
the router fetch from public addresses only (every address its host resolves to, and the connection
made to those very addresses, so that a name resolving anew cannot swap one in), or, when the
operator names hosts (--allowed-media-domains), from those hosts alone.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from router.errors import ValidationError

MAX_REDIRECTS = 5  # as browsers bound a chain, far below a loop's
_REDIRECTS = frozenset((301, 302, 303, 307, 308))


class NonPublicAddress(OSError):
    """A host that resolves to an address no request may make the router reach."""


class PublicResolver(AbstractResolver):
    """The system's resolver, refusing a host any of whose addresses is not public."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        addresses = await self._inner.resolve(host, port, family)
        for address in addresses:
            if not ipaddress.ip_address(address["host"]).is_global:
                raise NonPublicAddress(f"{host} resolves to {address['host']}, not a public "
                                       "address")
        return addresses

    async def close(self) -> None:
        await self._inner.close()


async def fetch_image(url: str, what: str, *, timeout: float, max_bytes: int,
                      allowed_hosts: frozenset[str] | None = None) -> bytes:
    """The body of `url`, an image; a ValidationError naming `what` and the problem otherwise.

    `allowed_hosts`: the only hosts fetched from (lower case), whatever their addresses; None:
    any host whose addresses are all public."""
    connector = aiohttp.TCPConnector(resolver=PublicResolver() if allowed_hosts is None else None)
    try:
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            current = url
            for _ in range(MAX_REDIRECTS + 1):
                _check_host(current, url, what, allowed_hosts)
                async with session.get(current, allow_redirects=False) as answer:
                    if answer.status in _REDIRECTS and "Location" in answer.headers:
                        current = str(URL(current).join(URL(answer.headers["Location"])))
                        continue
                    return await _image_body(answer, url, what, max_bytes)
    except ValidationError:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        raise ValidationError(f"{what}: {_short(url)} did not answer within {timeout:g} s "
                              "(--image-fetch-timeout)") from None
    except aiohttp.ClientConnectorError as err:
        if isinstance(err.os_error, NonPublicAddress):
            raise _not_public(what, url, str(err.os_error)) from None
        raise _unfetchable(what, url, err) from None
    except (aiohttp.ClientError, OSError, ValueError) as err:
        raise _unfetchable(what, url, err) from None
    raise ValidationError(f"{what}: {_short(url)} redirects more than {MAX_REDIRECTS} times")


def _check_host(current: str, url: str, what: str, allowed_hosts: frozenset[str] | None) -> None:
    """A ValidationError unless a request may make the router fetch `current` (a hop of `url`)."""
    parsed = URL(current)
    host = (parsed.host or "").lower()
    if parsed.scheme not in ("http", "https") or not host:
        raise ValidationError(f"{what}: {_short(url)} leads to {_short(current)}, not an http(s) "
                              "URL with a host")
    if allowed_hosts is not None:
        if host not in allowed_hosts:
            hop = "" if current == url else f" (redirected to {_short(current)})"
            raise ValidationError(f"{what}: {_short(url)}{hop} names host {host!r}, not one this "
                                  "server fetches images from (--allowed-media-domains)")
        return
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return  # a name: PublicResolver checks what it resolves to
    if not address.is_global:
        raise _not_public(what, url, f"{address} is not a public address")


async def _image_body(answer: aiohttp.ClientResponse, url: str, what: str,
                      max_bytes: int) -> bytes:
    if answer.status != 200:
        raise ValidationError(f"{what}: fetching {_short(url)} answered HTTP {answer.status}")
    kind = answer.content_type
    if not kind.startswith("image/"):
        raise ValidationError(f"{what}: {_short(url)} answered content type {kind!r}, not an "
                              "image (image/*)")
    if answer.content_length is not None and answer.content_length > max_bytes:
        raise _too_large(what, url, max_bytes)
    data = bytearray()
    async for piece in answer.content.iter_chunked(65536):
        data += piece
        if len(data) > max_bytes:
            raise _too_large(what, url, max_bytes)
    return bytes(data)


def _not_public(what: str, url: str, reason: str) -> ValidationError:
    return ValidationError(f"{what}: {_short(url)} is not fetched: {reason} (images are fetched "
                           "from public addresses only, unless the operator names the host in "
                           "--allowed-media-domains)")


def _unfetchable(what: str, url: str, err: Exception) -> ValidationError:
    return ValidationError(f"{what}: {_short(url)} could not be fetched "
                           f"({type(err).__name__}: {str(err)[:200]})")


def _too_large(what: str, url: str, max_bytes: int) -> ValidationError:
    return ValidationError(f"{what}: {_short(url)} is larger than {max_bytes} bytes "
                           "(--max-image-bytes)")


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."
