"""GET / (a chat playground) and GET /docs (Swagger UI).

The playground runs over the OpenAI and model routes, Swagger UI over /api-doc/openapi.json: files
shipped in this package and in swagger_ui_bundle, so a browser needs nothing but this server. TGI's
POST / stays TGI's (router/api/tgi/routes.py).
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web
from swagger_ui_bundle import swagger_ui_path

STATIC_DIR = Path(__file__).parent / "static"
SWAGGER_DIR = Path(swagger_ui_path)

# what each page loads; anything else under its prefix is a 404, never a listing or another file
# (swagger_ui_bundle's own index.html would open the Petstore example)
PAGE_FILES = frozenset({"app.js", "client.js", "docs.js", "style.css"})
SWAGGER_FILES = frozenset({"swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"})


def _file(path: Path) -> web.FileResponse:
    # the pages and the router are one version: a browser revalidates, and gets a 304 while
    # the file is unchanged (FileResponse answers If-Modified-Since)
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def playground(request: web.Request) -> web.FileResponse:
    return _file(STATIC_DIR / "index.html")


async def swagger_ui(request: web.Request) -> web.FileResponse:
    return _file(STATIC_DIR / "docs.html")


async def to_swagger_ui(request: web.Request) -> web.Response:
    # relative, so that a prefix a proxy adds is kept: /prefix/docs/ -> /prefix/docs
    raise web.HTTPMovedPermanently("../docs")


def _files_from(directory: Path, names: frozenset[str]):
    async def serve(request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in names:
            raise web.HTTPNotFound()
        return _file(directory / name)
    return serve


def register(app: web.Application) -> None:
    app.router.add_get("/", playground)
    app.router.add_get("/ui/{name}", _files_from(STATIC_DIR, PAGE_FILES))
    app.router.add_get("/docs", swagger_ui)
    app.router.add_get("/docs/", to_swagger_ui)
    app.router.add_get("/docs/{name}", _files_from(SWAGGER_DIR, SWAGGER_FILES))
