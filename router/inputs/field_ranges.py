"""Request fields read and checked against the ranges of the types they travel in.

The types are the shards' protobuf and TGI's Rust types; the readers are those every API uses for
optional numbers and booleans.

A value that passes an API's documented bounds must still fit the field that carries it: protobuf
raises on an out-of-range integer deep inside the batching loop, far from the request that sent it.
The wire checks answer with serde's wording, which TGI's clients already know.
"""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

from router.errors import ValidationError


@dataclass(frozen=True, slots=True)
class IntType:
    name: str  # as serde names it in its errors
    low: int
    high: int

    @property
    def openapi_format(self) -> str:
        # OpenAPI has no unsigned formats: a u32 needs int64 to hold its range; a u64 is written
        # int64 with its true maximum beside it, as generators of clients expect
        return "int32" if self.name == "i32" else "int64"


INT32 = IntType("i32", -2**31, 2**31 - 1)
UINT32 = IntType("u32", 0, 2**32 - 1)
UINT64 = IntType("u64", 0, 2**64 - 1)
# the largest finite float32: sampling parameters travel as protobuf floats
FLOAT32_MAX = 3.4028234663852886e38


def _deserialize_error(path: str, detail: str) -> ValidationError:
    return ValidationError(f"Failed to deserialize the JSON body into the target type: {path}: "
                           f"{detail}")


def check_int(path: str, value, wire: IntType) -> int:
    """`value` as an int of `wire`'s range; a float with no fraction counts (serde's does too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _deserialize_error(path, f"invalid type: {type(value).__name__} {value!r}, "
                                       f"expected {wire.name}")
    if isinstance(value, float) and not value.is_integer():
        raise _deserialize_error(path, f"invalid type: floating point `{value}`, expected "
                                       f"{wire.name}")
    value = int(value)
    if not wire.low <= value <= wire.high:
        raise _deserialize_error(path, f"invalid value: integer `{value}`, expected {wire.name}")
    return value


def checked_token_ids(ids: list, path: str, vocab_size: int) -> list[int]:
    """`ids` checked as token ids of a vocabulary of `vocab_size` (each a u32 below it)."""
    out = []
    for i, token in enumerate(ids):
        token = check_int(f"{path}[{i}]", token, UINT32)
        if token >= vocab_size:
            raise ValidationError(f"`{path}[{i}]` = {token} is not a token id (the vocabulary has "
                                  f"{vocab_size})")
        out.append(token)
    return out


def float32(value: float) -> float:
    """The float32 nearest `value` (the value a shard receives; inf past float32's range)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def check_float(path: str, value) -> float:
    """`value` as the float32 it travels as.

    Finite, and rounded as the shards will read it, so that a bound checked after this holds for
    what they use (1e-46 is 0 there, as for serde's f32)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _deserialize_error(path, f"invalid type: {type(value).__name__} {value!r}, "
                                       "expected f32")
    # compared before converting: an integer literal of 400 digits overflows float()
    if not -FLOAT32_MAX <= value <= FLOAT32_MAX:
        raise _deserialize_error(path, f"invalid value: `{value}`, expected a finite f32")
    value = float32(float(value))
    if not math.isfinite(value):  # between the largest float32 and the next: rounded up to inf
        raise _deserialize_error(path, f"invalid value: `{value}`, expected a finite f32")
    return value


def check_logit_bias(path: str, value, vocab_size: int = 0, *,
                     listed: bool = False) -> dict[int, float]:
    """OpenAI's logit_bias as {token id: float32 bias}, checked.

    It arrives as {"<token id>": bias in [-100, 100]}; each id must be below the model's
    `vocab_size` (when known: else the shard refuses the request). With `listed`, TGI's
    document's form is taken too: a list of biases, the i-th for token id i."""
    if value is None:
        return {}
    if listed and isinstance(value, list):
        return _listed_logit_bias(path, value, vocab_size)
    if not isinstance(value, dict):
        raise ValidationError(f"`{path}` must be an object mapping token ids to biases"
                              + (" or a list of biases indexed by token id" if listed else ""))
    biases = {}
    for key, bias in value.items():
        # ASCII digits without leading zeros: "٥", "５" or "05" would name token 5 too
        token = int(key) if re.fullmatch(r"0|[1-9][0-9]{0,9}", key) else -1
        if not UINT32.low <= token <= UINT32.high:
            raise ValidationError(f"`{path}` keys must be token ids (decimal integers). "
                                  f"Given: {key!r}")
        if vocab_size and token >= vocab_size:
            raise ValidationError(f"`{path}` keys must be token ids below the model's vocabulary "
                                  f"size of {vocab_size}. Given: {key!r}")
        biases[token] = _bias(f"{path}[{key!r}]", bias)
    return biases


def _listed_logit_bias(path: str, value: list, vocab_size: int) -> dict[int, float]:
    """TGI's list form: the i-th bias for token id i; a 0 changes nothing and is not sent."""
    if len(value) > (vocab_size or UINT32.high + 1):
        raise ValidationError(f"`{path}` lists a bias per token id: at most the model's "
                              f"vocabulary size of {vocab_size}. Given: {len(value)}")
    biases = {}
    for token, bias in enumerate(value):
        bias = _bias(f"{path}[{token}]", bias)
        if bias:
            biases[token] = bias
    return biases


def _bias(path: str, bias) -> float:
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
        raise ValidationError(f"`{path}` must be a number >= -100 and <= 100")
    return float32(float(bias))


F32 = "f32"  # read_number's `wire` for a float field


def read_flag(body: dict, name: str, default: bool = False, *, path: str | None = None) -> bool:
    """An optional boolean field.

    Null is the default, anything but true or false is a 422 naming `path` (the field's name unless
    given)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValidationError(f"`{path or name}` must be a boolean")
    return value


def read_number(body: dict, name: str, low: float | None = None, high: float | None = None, *,
                default=None, integer: bool = False, low_open: bool = False,
                path: str | None = None, wire: IntType | str | None = None):
    """An optional number (null: `default`) within [low, high], or (low, high] with `low_open`.

    With `wire` (an IntType, or F32 for a float), the value must first fit what carries it, and
    a wrong type or range is refused in serde's words (check_int, check_float); without it, in
    the field's own. A float is rounded to the float32 the shards receive before its bounds are
    checked: a field rounded to 0 is 0 there."""
    path = path or name
    value = body.get(name)
    if value is None:
        return default
    if isinstance(wire, IntType):
        value = check_int(path, value, wire)
    elif wire == F32:
        value = check_float(path, value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and isinstance(value, float) and not value.is_integer()):
        raise ValidationError(f"`{path}` must be {'an integer' if integer else 'a number'}")
    elif integer:
        value = int(value)
    elif (low is None or low <= value) and (high is None or value <= high):
        value = float32(value)  # compared first: float() of a 400-digit integer overflows
    too_low = low is not None and (value < low or (low_open and value == low))
    if too_low or (high is not None and value > high):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValidationError(f"`{path}` must be {bound} and <= {high}. Given: {value}")
    return value


def check_fields(body: dict, allowed: set[str], where: str) -> None:
    for name in body:
        if name not in allowed:
            raise ValidationError(f"`{name}` is not a field of {where}")
