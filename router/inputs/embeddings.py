"""What every embedding API shares: reading inputs, Matryoshka prefixes, normalization, base64.

Plain functions over float32 vectors: the APIs (OpenAI's, TEI's, Ollama's) read their own fields
and call these; router/core/embedding.py computes the vectors. Done in numpy, on the event loop
that also sends every stream's tokens: a batch of vectors costs it well under a millisecond.
"""
from __future__ import annotations

import base64

import numpy

from router.errors import NotServedError, ValidationError


def read_inputs(value: object, field: str, *, max_inputs: int) -> list[str | list[int]]:
    """A string, a list of strings, token ids, or a list of lists of token ids -> the inputs.

    Each input is a text or its token ids; an empty list or text, or a mix of forms, is a 422
    naming `field`."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ValidationError(f"`{field}` must be a string, a list of strings, a list of token "
                              "ids or a list of lists of token ids, and not empty", param=field)
    if len(items) > max_inputs:
        raise ValidationError(f"`{field}` holds {len(items)} inputs; at most {max_inputs} are "
                              "taken in one request", param=field)
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ValidationError(f"`{field}`[{index}] is an empty string", param=field)
        elif not (isinstance(item, list) and item and all(_is_id(v) for v in item)):
            raise ValidationError(f"`{field}`[{index}] must be a string or a non-empty list of "
                                  "token ids", param=field)
    return items


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_dimensions(value: object, field: str, *, hidden_size: int, matryoshka: bool,
                    allowed: tuple[int, ...]) -> int | None:
    """The prefix of the embedding a request asks for; None: all of it.

    Only a model that declares Matryoshka embeddings gives a prefix (another's prefix is no
    embedding); asking for the whole width is always fine."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"`{field}` must be a positive integer", param=field)
    if value == hidden_size:
        return None
    if value > hidden_size:
        raise ValidationError(f"`{field}` {value} is more than the model's {hidden_size}",
                              param=field)
    if not matryoshka:  # a 400, as for a model that does not embed: the model's, not the field's
        raise NotServedError(f"`{field}` {value} is refused: this model does not declare "
                             f"Matryoshka embeddings, so only its full {hidden_size} are one",
                             param=field)
    if allowed and value not in allowed:
        raise ValidationError(f"`{field}` must be one of {', '.join(map(str, allowed))} for this "
                              "model", param=field)
    return value


def finished(vectors: list[numpy.ndarray], *, normalize: bool,
             dimensions: int | None) -> numpy.ndarray:
    """The vectors an API answers [n, width]: prefixes and unit length where asked.

    Each vector's prefix where `dimensions` asks, then scaled to length 1 where `normalize`. A
    prefix of a normalized embedding is normalized again: its length is no longer 1."""
    matrix = numpy.stack(vectors).astype(numpy.float32, copy=False)
    if dimensions is not None:
        matrix = matrix[:, :dimensions]
    if normalize:
        norms = numpy.linalg.norm(matrix, axis=1, keepdims=True)
        matrix = matrix / numpy.where(norms > 0, norms, 1)
    return matrix


def as_base64(vector: numpy.ndarray) -> str:
    """OpenAI's encoding_format "base64": the float32 values, little-endian, base64-encoded."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
