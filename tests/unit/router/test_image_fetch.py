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


@pytest.fixture
async def server():
    app = web.Application()
    for path, handler in (("/png", _png), ("/slow", _slow), ("/huge", _huge), ("/loop", _loop),
                          ("/page", _page), ("/missing", _missing), ("/once", _once)):
        app.router.add_get(path, handler)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server
    await test_server.close()


LIMITS = MediaLimits(fetch_timeout=0.5, max_image_bytes=1_000_000)


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
