"""What every embedding API shares: reading inputs, Matryoshka prefixes, normalization, base64.

Plain functions over lists of floats: the APIs (OpenAI's, TEI's, Ollama's) read their own fields
and call these; router/core/embedding.py computes the vectors.
"""
from __future__ import annotations

import base64
import math
import struct

from router.errors import ValidationError


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
    if not matryoshka:
        raise ValidationError(f"`{field}` {value} is refused: this model does not declare "
                              f"Matryoshka embeddings, so only its full {hidden_size} are one",
                              param=field)
    if allowed and value not in allowed:
        raise ValidationError(f"`{field}` must be one of {', '.join(map(str, allowed))} for this "
                              "model", param=field)
    return value


def finished(vector: list[float], *, normalize: bool, dimensions: int | None) -> list[float]:
    """The vector an API answers: its prefix where asked, then scaled to length 1 where asked.

    A prefix of a normalized embedding is normalized again: its length is no longer 1."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(sum(v * v for v in vector))
        if norm > 0:
            vector = [v / norm for v in vector]
    return vector


def as_base64(vector: list[float]) -> str:
    """OpenAI's encoding_format "base64": the float32 values, little-endian, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
