"""Image URLs fetched by the router from a local server: the bounds on time, size, redirects, type."""
import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.errors import ValidationError
from router.inputs.images.fetch import MAX_REDIRECTS
from router.inputs.images.sources import ImageSource, MediaLimits, load_images, read_source
from tests.image_files import image_bytes

PNG = image_bytes(10, 7)
HITS = web.AppKey("hits", list)  # the paths the local server was asked for


async def _png(request):
    return web.Response(body=PNG, content_type="image/png")


async def _slow(request):
    await asyncio.sleep(5)
    return web.Response(body=PNG, content_type="image/png")


async def _huge(request):
    """A body with no Content-Length that never ends within the bound."""
    answer = web.StreamResponse(headers={"Content-Type": "image/png"})
    await answer.prepare(request)
    for _ in range(64):
        await answer.write(b"\0" * 65536)
    return answer


async def _loop(request):
    raise web.HTTPFound("/loop")


async def _page(request):
    return web.Response(text="<html>not an image</html>", content_type="text/html")


async def _missing(request):
    raise web.HTTPNotFound()


async def _once(request):
    raise web.HTTPFound("/png")


async def _away(request):
    """A redirect to the same server by another name."""
    raise web.HTTPFound(f"http://localhost:{request.url.port}/png")


@pytest.fixture
async def server():
    hits = []

    @web.middleware
    async def count(request, handler):
        hits.append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[count])
    app[HITS] = hits
    for path, handler in (("/png", _png), ("/slow", _slow), ("/huge", _huge), ("/loop", _loop),
                          ("/page", _page), ("/missing", _missing), ("/once", _once),
                          ("/away", _away)):
        app.router.add_get(path, handler)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server
    await test_server.close()


# the local server is a host the operator names: without it, loopback is refused
LIMITS = MediaLimits(fetch_timeout=0.5, max_image_bytes=1_000_000,
                     allowed_hosts=frozenset({"127.0.0.1"}))


async def test_an_image_url_and_a_redirect_to_one_are_fetched(server):
    for path in ("/png", "/once"):
        assert await read_source(ImageSource(str(server.make_url(path)), "x"), LIMITS) == PNG
    (loaded,) = await load_images([ImageSource(str(server.make_url("/png")), "x")], LIMITS)
    assert (loaded.size.width, loaded.size.height) == (10, 7)


@pytest.mark.parametrize("path, words", [
    ("/slow", "did not answer within 0.5 s"),
    ("/huge", "is larger than 1000000 bytes"),
    ("/loop", f"redirects more than {MAX_REDIRECTS} times"),
    ("/page", "content type 'text/html', not an image"),
    ("/missing", "answered HTTP 404"),
])
async def test_a_bad_url_is_a_422_naming_the_problem(server, path, words):
    started = asyncio.get_running_loop().time()
    with pytest.raises(ValidationError) as caught:
        await read_source(ImageSource(str(server.make_url(path)), "messages[0].content[0]"),
                          LIMITS)
    assert words in caught.value.message
    assert caught.value.message.startswith("messages[0].content[0]")
    assert asyncio.get_running_loop().time() - started < 3


async def test_an_unreachable_host_is_a_422(unused_tcp_port):
    with pytest.raises(ValidationError, match="could not be fetched"):
        await read_source(ImageSource(f"http://127.0.0.1:{unused_tcp_port}/a.png", "x"), LIMITS)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3",
                                  "0.0.0.0", "[::ffff:127.0.0.1]"])
async def test_without_allowed_hosts_only_public_addresses_are_fetched(server, host):
    """Loopback, link-local (cloud metadata), private and unspecified addresses, by address or
    by a name resolving to one, are refused before any connection to them."""
    url = f"http://{host}:{server.port}/png"
    before = len(server.app[HITS])
    with pytest.raises(ValidationError, match="not a public address") as caught:
        await read_source(ImageSource(url, "image"), MediaLimits(fetch_timeout=2))
    assert "--allowed-media-domains" in caught.value.message
    assert len(server.app[HITS]) == before, "the server was never reached"


async def test_allowed_hosts_are_the_only_ones_fetched_at_every_redirect(server):
    with pytest.raises(ValidationError, match="names host 'localhost', not one this server"):
        await read_source(ImageSource(str(server.make_url("/png")).replace("127.0.0.1",
                                                                           "localhost"), "x"),
                          LIMITS)
    with pytest.raises(ValidationError, match=r"redirected to http://localhost:\d+/png\) names"):
        await read_source(ImageSource(str(server.make_url("/away")), "x"), LIMITS)
    both = MediaLimits(fetch_timeout=2, allowed_hosts=frozenset({"127.0.0.1", "localhost"}))
    assert await read_source(ImageSource(str(server.make_url("/away")), "x"), both) == PNG


async def test_the_resolver_refuses_a_name_with_any_non_public_address(monkeypatch):
    import aiohttp

    from router.inputs.images.fetch import NonPublicAddress, PublicResolver

    answers = {"public.test": ["93.184.216.34"], "mixed.test": ["93.184.216.34", "10.0.0.7"]}

    async def resolve(self, host, port=0, family=0):
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0,
                 "flags": 0} for a in answers[host]]

    monkeypatch.setattr(aiohttp.ThreadedResolver, "resolve", resolve)
    resolver = PublicResolver()
    assert [a["host"] for a in await resolver.resolve("public.test", 80)] == ["93.184.216.34"]
    with pytest.raises(NonPublicAddress, match="mixed.test resolves to 10.0.0.7"):
        await resolver.resolve("mixed.test", 80)
    await resolver.close()


def test_the_flag_takes_host_names_and_addresses_alone():
    from router.config.server import ServerSettings

    assert ServerSettings().media_hosts() is None
    hosts = ServerSettings(allowed_media_domains=" Images.Example.com,127.0.0.1,[::1], ")
    assert hosts.media_hosts() == {"images.example.com", "127.0.0.1", "::1"}
    for bad in ("https://images.example.com", "images.example.com:8080", "a.example/x"):
        with pytest.raises(ValueError, match="without a scheme, port or path"):
            ServerSettings(allowed_media_domains=bad)
