"""Structured-output requests -> a grammar the shards enforce: (kind, value), checked before queueing.

Sources: TGI's `grammar` parameter, OpenAI's `response_format`, and tool calling (a JSON schema that
admits calls of the offered functions).
"""
from __future__ import annotations

import json

import llguidance

from router.errors import ValidationError
from router.inputs import json_text

JSON = "json"
REGEX = "regex"
EBNF = "ebnf"  # GBNF (`root ::= ...`, as SGLang and llama.cpp write it) or Lark
NO_TOOL = "no_tool"  # the pseudo-function a model calls under tool_choice=auto to answer in text


def checked(kind: str, value) -> tuple[str, str]:
    """(kind, value as text) after llguidance accepted it; a 422 that names the problem if not."""
    try:
        source, text = _source(kind, value)
    except ValueError as err:  # llguidance's own refusals (a bool schema, a bad pattern...)
        raise ValidationError(f"grammar is not valid: {err}") from None
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        raise ValidationError(f"grammar is not valid: {error.strip()}")
    return kind, text


def _source(kind: str, value) -> tuple[str, str]:
    """llguidance's grammar for the constraint, and the constraint as text for the shards."""
    if kind == JSON:
        value = close_objects(schema_value(value, "grammar"))
        source = llguidance.LLMatcher.grammar_from_json_schema(
            value, defaults={"whitespace_flexible": False})
        return source, json.dumps(value)
    if kind == REGEX:
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a regex must be a string")
        return llguidance.LLMatcher.grammar_from_regex(value), value
    if kind == EBNF:
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: an EBNF grammar must be a string")
        return llguidance.grammar_from("ebnf", value), value
    raise ValidationError(f"grammar type {kind!r} is not supported (json, regex, ebnf)")


def schema_value(value, where: str):
    """A JSON schema given as an object or as its text; `where` names it in a refusal."""
    if isinstance(value, str):
        try:  # nested at most as deep as a request body may be
            value = json_text.loads(value)
        except json_text.JSONError as err:
            raise ValidationError(f"{where} is not valid: the JSON schema is not JSON: {err}") \
                from None
    if not isinstance(value, (dict, bool)):
        raise ValidationError(f"{where} is not valid: a JSON schema must be an object (or its "
                              "text)")
    return value


def close_objects(schema):
    """Objects that list their properties admit no others unless the schema says so.

    JSON Schema's default admits any extra property, and a small model given that freedom tends to
    invent keys until it runs out of tokens. Every output of the closed schema is still valid
    against the original one.
    """
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: close_objects(v) for k, v in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed \
            and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def from_tgi(grammar) -> tuple[str, str]:
    """TGI's grammar: {"type": "json" | "regex", "value": ...}, and TGI 3's other forms.

    TGI 3 adds {"type": "json_schema", "value": {"name": ..., "schema": <the schema>}} and takes
    "json_object" as another name of "json"."""
    if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
        raise ValidationError("grammar must be an object with `type` (json or regex) and `value`")
    if not isinstance(grammar["type"], str):
        raise ValidationError("grammar `type` must be a string: json or regex")
    kind, value = grammar["type"], grammar["value"]
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError("grammar `value` of type json_schema must be an object "
                                  "holding a `schema` ({\"name\": ..., \"schema\": {...}})")
        return checked(JSON, value["schema"])
    kind = {"json_object": JSON}.get(kind, kind)
    if kind not in (JSON, REGEX):  # TGI's grammar types; EBNF comes through SGLang's `ebnf`
        raise ValidationError(f"grammar type {kind!r} is not supported (json, regex, "
                              "json_schema)")
    return checked(kind, value)


def from_response_format(response_format) -> tuple[str, str] | None:
    """OpenAI's response_format (text, json_object, json_schema) and TGI's grammar forms.

    A `json_schema` holding OpenAI's `json_schema` object is OpenAI's; one holding `value` is TGI
    3's, as is a `json_object` with a `value` (TGI's name for a schema of type json)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValidationError("`response_format` must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind in (JSON, REGEX) or (kind in ("json_schema", "json_object")
                                 and "value" in response_format):
        return from_tgi(response_format)
    if kind == "json_object":
        return checked(JSON, {"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValidationError("`response_format.json_schema` must hold a `schema`")
        return checked(JSON, spec["schema"])
    raise ValidationError(f"`response_format.type` {kind!r} is not one of text, json_object, "
                          "json_schema, json, regex")


def tool_call_schema(functions: list[dict], *, allow_text: bool, parallel: bool = False) -> dict:
    """Calls of `functions`: {"name": <its name>, "arguments": <its parameters>}.

    One call, or a list of at least one when `parallel`; under `allow_text`, the no_tool call
    answering in words instead."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f["name"]},
                               "arguments": f.get("parameters") or {"type": "object"}}}
               for f in functions]
    calls = options[0] if len(options) == 1 else {"anyOf": options}
    if parallel:
        calls = {"type": "array", "items": calls, "minItems": 1}
    if not allow_text:
        return calls
    no_tool = {"type": "object", "additionalProperties": False,
               "required": ["name", "arguments"], "properties": {
                   "name": {"const": NO_TOOL},
                   "arguments": {"type": "object", "required": ["content"],
                                 "additionalProperties": False,
                                 "properties": {"content": {"type": "string"}}}}}
    return {"anyOf": [*(calls["anyOf"] if "anyOf" in calls else [calls]), no_tool]}
