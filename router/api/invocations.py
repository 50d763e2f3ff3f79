"""TGI's /invocations (SageMaker's route), dispatched by the body's fields.

One body, served by the route its fields name, as TGI's untagged SagemakerRequest reads it: `inputs`
is POST /'s, `messages` chat's, `prompt` the legacy completions'.
"""
from __future__ import annotations

from aiohttp import web

from router.api.openai import chat as openai
from router.api.openai import completions
from router.api.tgi import routes as tgi
from router.errors import ValidationError
from router.http.json_body import read_object


async def invocations(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)  # aiohttp keeps the bytes: the route reads them again
    for field, handler in (("inputs", tgi.compat_generate), ("messages", openai.chat_completions),
                           ("prompt", completions.completions)):
        if field in body:
            return await handler(request)
    raise ValidationError("Failed to deserialize the JSON body into the target type: data did "
                          "not match any variant of SagemakerRequest (a generate request with "
                          "`inputs`, a chat request with `messages` or a completion request "
                          "with `prompt`)")


def register(app: web.Application) -> None:
    app.router.add_post("/invocations", invocations)
