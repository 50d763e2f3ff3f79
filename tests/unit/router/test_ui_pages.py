"""The pages at / and /docs and their files, over the real app with a scripted shard: they load
with or without --api-key, while the API behind them keeps its key and TGI's POST / its route."""
import re

import pytest

from router.api.openapi import openapi_document
from router.api.ui.routes import PAGE_FILES, SWAGGER_FILES
from tests.unit.router.test_api_errors import HealthyFake, _body, _client

KEY = {"Authorization": "Bearer s3cret"}


async def _assets(client, path: str) -> list[str]:
    """The page at `path` and every file it loads (linked under ui/ or docs/), each asserted to
    load; every link of the page."""
    page = await client.get(path)
    assert page.status == 200, path
    assert page.content_type == "text/html"
    html = await page.text()
    linked = re.findall(r'(?:src|href)="([^"#:]+)"', html)
    assert linked, html
    # beside its files, the playground links to /docs and to the API document, which needs the key
    assert set(linked) - {"docs", "api-doc/openapi.json"} == {
        link for link in linked if link.startswith(("ui/", "docs/"))}
    for link in linked:
        if link in ("docs", "api-doc/openapi.json"):
            continue
        url = "/" + link  # relative to a page at the root: /, /docs
        reply = await client.get(url)
        assert reply.status == 200, url
        assert len(await reply.read()) > 0, url
    return linked


@pytest.mark.parametrize("api_key", [None, "s3cret"])
async def test_the_pages_and_their_files_load_with_or_without_a_key(tiny_llama, api_key):
    client = await _client(tiny_llama, HealthyFake(), api_key=api_key)
    try:
        linked = await _assets(client, "/")
        assert {"ui/app.js", "ui/style.css", "docs"} <= set(linked)
        app = await (await client.get("/ui/app.js")).text()
        assert "v1/chat/completions" in app and "import" in app
        assert (await client.get("/ui/client.js")).status == 200  # imported by app.js
        assert (await client.get("/ui/app.js")).headers["Cache-Control"] == "no-cache"
        linked = await _assets(client, "/docs")
        assert {"docs/swagger-ui.css", "docs/swagger-ui-bundle.js", "ui/docs.js"} <= set(linked)
        bundle = await client.get("/docs/swagger-ui-bundle.js")
        assert "SwaggerUIBundle" in await bundle.text()
        assert "api-doc/openapi.json" in await (await client.get("/ui/docs.js")).text()
        head = await client.head("/")
        assert head.status == 200
        redirect = await client.get("/docs/", allow_redirects=False)
        assert redirect.status == 301 and redirect.headers["Location"] == "../docs"
    finally:
        await client.close()


async def test_with_a_key_the_api_behind_the_pages_still_needs_it(tiny_llama):
    client = await _client(tiny_llama, HealthyFake(), api_key="s3cret")
    try:
        for method, path in (("GET", "/v1/models"), ("GET", "/api-doc/openapi.json"),
                             ("POST", "/"), ("POST", "/v1/chat/completions"),
                             ("PUT", "/v1/models/x/start"), ("POST", "/v1/models/pull"),
                             ("POST", "/docs"), ("POST", "/ui/app.js")):
            reply = await client.request(method, path, json=_body())
            assert reply.status == 401, (method, path)
            assert (await reply.json())["error_type"] == "authentication"
        assert (await client.get("/v1/models", headers=KEY)).status == 200
        docs = await client.get("/api-doc/openapi.json", headers=KEY)
        assert docs.status == 200
    finally:
        await client.close()


async def test_only_the_files_the_pages_use_are_served(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        for path in ("/ui/index.html", "/ui/docs.html", "/ui/nope.js", "/ui/", "/ui/..%2Frouter",
                     "/docs/index.html", "/docs/swagger-initializer.js", "/docs/..%2F..%2Fapp.py"):
            reply = await client.get(path)
            assert reply.status == 404, path
            assert "error" in await reply.json()  # the API's own error shape, not a page
        for name in PAGE_FILES:
            assert (await client.get(f"/ui/{name}")).status == 200, name
        for name in SWAGGER_FILES:
            assert (await client.get(f"/docs/{name}")).status == 200, name
    finally:
        await client.close()


async def test_post_slash_is_still_tgis_generate_route(tiny_llama):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/", json=_body(max_new_tokens=3))
        assert reply.status == 200
        answer = await reply.json()
        assert isinstance(answer, list) and answer[0]["generated_text"]
        bad = await client.post("/", json={"inputs": "", "parameters": {}})
        assert bad.status == 422 and (await bad.json())["error_type"] == "validation"
        assert (await client.put("/")).status == 405
    finally:
        await client.close()


def test_the_openapi_document_lists_the_pages_beside_tgis_post():
    paths = openapi_document()["paths"]
    assert set(paths["/"]) == {"get", "post"}
    assert "text/html" in paths["/"]["get"]["responses"]["200"]["content"]
    assert "text/html" in paths["/docs"]["get"]["responses"]["200"]["content"]
