"""OpenAI's /v1/embeddings, with vLLM's pooling fields and SGLang's {"text": ...} inputs.

SGLang serves embeddings on this same OpenAI route; its inputs may also be objects holding a
`text` (an `image` beside it is refused: no model here embeds images).
"""
from __future__ import annotations

from aiohttp import web

from router.api.openai.request import model_name
from router.core.embedding import embed_inputs
from router.errors import ValidationError
from router.http.json_body import read_object
from router.http.json_out import dumps
from router.inputs.embeddings import as_base64, finished, read_dimensions, read_inputs
from router.inputs.field_ranges import read_flag
from router.state import model_and_adapter

# OpenAI's own bound on the inputs of one request
MAX_INPUTS = 2048


def _sglang_texts(value: object) -> object:
    """SGLang's [{"text": ...}] inputs as plain strings; anything else as given."""
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return value
    texts = []
    for index, item in enumerate(value):
        if item.get("image") is not None:
            raise ValidationError(f"`input`[{index}].image is refused: no model here embeds "
                                  "images", param="input")
        if not isinstance(item.get("text"), str):
            raise ValidationError(f"`input`[{index}].text must be a string", param="input")
        texts.append(item["text"])
    return texts


def _keep_last(body: dict, limit: int) -> int | None:
    """vLLM's truncate_prompt_tokens: the last k tokens of each input; -1: the model's limit."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValidationError("`truncate_prompt_tokens` must be -1 or a positive integer")
    return limit if value == -1 else value


async def embeddings(request: web.Request) -> web.Response:
    body = await read_object(request)
    served, adapter = model_and_adapter(request, model_name(body))
    if adapter is not None:
        raise ValidationError("`model` names a LoRA adapter: embeddings come from a base model",
                              param="model")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ValidationError("`encoding_format` must be float or base64")
    info = served.shard_info
    dimensions = read_dimensions(body.get("dimensions"), "dimensions",
                                 hidden_size=info.hidden_size, matryoshka=info.matryoshka,
                                 allowed=info.matryoshka_dimensions)
    normalize = read_flag(body, "normalize", info.normalize)
    inputs = read_inputs(_sglang_texts(body.get("input")), "input", max_inputs=MAX_INPUTS)
    limit = info.max_embed_tokens or info.max_position_embeddings
    result = await served.infer.count_request(embed_inputs(
        served, inputs, field="input", keep_last=_keep_last(body, limit)))
    vectors = finished(result.vectors, normalize=normalize, dimensions=dimensions)
    data = [{"object": "embedding", "index": index,
             "embedding": as_base64(vector) if encoding == "base64" else vector}
            for index, vector in enumerate(vectors)]
    text = await dumps({
        "object": "list", "data": data, "model": served.model_name,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}},
        numbers=0 if encoding == "base64" else vectors.size)
    return web.Response(text=text, content_type="application/json")


def register(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
