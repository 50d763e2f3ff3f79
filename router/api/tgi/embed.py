"""text-embeddings-inference's POST /embed: `inputs`, `normalize`, `truncate`, `dimensions`.

Its answer is the list of vectors alone; its errors TEI's (and TGI's) {"error", "error_type"}.
`X-Model-Id` names the model, as on TGI's other routes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy
from aiohttp import web

from router.core.embedding import embed_inputs
from router.errors import ValidationError
from router.http.json_body import read_object
from router.http.json_out import dumps
from router.inputs.embeddings import finished, read_dimensions, read_inputs
from router.inputs.field_ranges import read_flag
from router.state import served_model

if TYPE_CHECKING:
    from router.lifecycle.served_model import ServedModel

FIELDS = {"inputs", "normalize", "truncate", "truncation_direction", "dimensions", "prompt_name"}
MAX_INPUTS = 2048


async def embed(request: web.Request) -> web.Response:
    body = await read_object(request)
    vectors = (await embed_body(lambda: served_model(request), body)).vectors
    text = await dumps(vectors, numbers=vectors.size)
    return web.Response(text=text, content_type="application/json")


@dataclass(slots=True)
class EmbedAnswer:
    vectors: numpy.ndarray  # [inputs, width] float32, as /embed answers them
    prompt_tokens: int  # the tokens computed, special tokens included


async def embed_body(model: Callable[[], ServedModel], body: dict) -> EmbedAnswer:
    """What /embed answers for a TEI body, validated and counted as a request of `model()`.

    The model is looked up once the body's own fields are checked. The public gRPC API's Embed
    gives its body to the same function."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ValidationError(f"`{unknown[0]}` is not a field of /embed; it takes "
                              f"{', '.join(sorted(FIELDS))}")
    if body.get("prompt_name") is not None:
        raise ValidationError("`prompt_name` is refused: no prompts are configured for this model")
    direction = body.get("truncation_direction", "Right")
    if direction not in ("Right", "Left", "right", "left"):
        raise ValidationError("`truncation_direction` must be Right or Left")
    served = model()
    info = served.shard_info
    dimensions = read_dimensions(body.get("dimensions"), "dimensions",
                                 hidden_size=info.hidden_size, matryoshka=info.matryoshka,
                                 allowed=info.matryoshka_dimensions)
    normalize = read_flag(body, "normalize", True)  # TEI's default
    truncate = read_flag(body, "truncate", False)
    inputs = read_inputs(body.get("inputs"), "inputs", max_inputs=MAX_INPUTS)
    limit = info.max_embed_tokens or info.max_position_embeddings
    left = truncate and direction.lower() == "left"
    result = await served.infer.count_request(embed_inputs(
        served, inputs, field="inputs", truncate=truncate and not left,
        keep_last=limit if left else None))
    return EmbedAnswer(finished(result.vectors, normalize=normalize, dimensions=dimensions),
                       result.prompt_tokens)


def register(app: web.Application) -> None:
    app.router.add_post("/embed", embed)
