"""vLLM's structured-output fields on the OpenAI routes -> the one grammar a request is held to.

`guided_choice`, `guided_json`, `guided_regex`, `guided_grammar` (vLLM up to 0.11),
`structured_outputs` (its newer form), their options, and the rule that a request takes one
constraint: two (a guided field and `response_format` or forced tools) are a 422 naming both.
"""
from __future__ import annotations

import json

import llguidance

from router.errors import ValidationError
from router.inputs import json_text, structured_output
from router.inputs.structured_output import EBNF, JSON, REGEX

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
OPTION_FIELDS = ("guided_decoding_backend", "guided_whitespace_pattern")
# the backends whose outputs ours are: llguidance is vLLM's `guidance` backend
_BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's backend options (`guidance:disable-any-whitespace`), each already how llguidance runs
# here: compact JSON, objects that list their properties closed, no fallback to another backend
_BACKEND_OPTIONS = ("disable-any-whitespace", "disable-additional-properties", "no-fallback")
# structured_outputs' kinds (vLLM's StructuredOutputsParams); `choices` is the spelling of vLLM's
# own documentation example
_KINDS = ("json", "regex", "choice", "choices", "grammar", "json_object", "structural_tag")
# its options, each true or false: true is how llguidance runs here, and false admits a superset
# of what is generated (any whitespace, extra properties; a fallback never happens)
_FLAGS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
# Rust's regex metacharacters (regex_syntax::escape), the dialect llguidance reads
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _escaped(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choice_pattern(field: str, choices) -> str:
    """A regex matching exactly one of `choices`."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValidationError(f"`{field}` must be a non-empty list of strings")
    return "|".join(f"({_escaped(c)})" for c in choices)


def _schema(field: str, value):
    """A JSON schema given as an object or as its text."""
    return structured_output.schema_value(value, f"`{field}`")


def _checked(field: str, kind: str, value) -> tuple[str, str]:
    try:
        return structured_output.checked(kind, value)
    except ValidationError as err:
        raise ValidationError(f"`{field}`: {err.message}", param=field) from None


def structural_tag_grammar(field: str, spec) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers"}) as Lark.

    Each structure's JSON schema holds between its begin and end, wherever the model writes a
    trigger; the text around them is free (vLLM's guidance backend builds the same grammar)."""
    if isinstance(spec, str):
        try:
            spec = json_text.loads(spec)
        except json_text.JSONError as err:
            raise ValidationError(f"`{field}` is not JSON: {err}") from None
    shape = ("an object {\"structures\": [{\"begin\": ..., \"schema\": ..., \"end\": ...}], "
             "\"triggers\": [...]}")
    if not isinstance(spec, dict):
        raise ValidationError(f"`{field}` must be {shape}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) \
            or not all(isinstance(t, str) and t for t in triggers):
        raise ValidationError(f"`{field}` must be {shape}")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end"), str) or "schema" not in structure:
            raise ValidationError(f"`{field}.structures[{i}]` must be {{\"begin\": ..., "
                                  "\"schema\": ..., \"end\": ...}")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValidationError(f"`{field}.structures[{i}].begin` starts with none of the "
                                  "`triggers`")
        schema = _schema(f"{field}.structures[{i}].schema", structure["schema"])
        if not isinstance(schema, dict):
            raise ValidationError(f"`{field}.structures[{i}].schema` must be a JSON schema object")
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"],
                                         grammar=schema, end=structure["end"]))
    try:
        return llguidance.StructTag.to_grammar(tags)
    except (AssertionError, ValueError) as err:  # llguidance's own checks of the tags
        raise ValidationError(f"`{field}` is not valid: {err}") from None


def _structured_outputs(spec) -> tuple[str, tuple[str, str], str | None]:
    """vLLM's `structured_outputs` object: its field name, grammar and whitespace pattern."""
    if not isinstance(spec, dict):
        raise ValidationError("`structured_outputs` must be an object with one of "
                              f"{', '.join(k for k in _KINDS if k != 'choices')}")
    unknown = [k for k in spec if k not in (*_KINDS, *_FLAGS, "whitespace_pattern")]
    if unknown:
        raise ValidationError(f"`structured_outputs.{unknown[0]}` is not a field of "
                              f"structured_outputs (kinds: {', '.join(_KINDS)}; options: "
                              f"{', '.join(_FLAGS)}, whitespace_pattern)")
    for flag in _FLAGS:
        if spec.get(flag) is not None and not isinstance(spec[flag], bool):
            raise ValidationError(f"`structured_outputs.{flag}` must be a boolean")
    given = [k for k in _KINDS if spec.get(k) is not None]
    if len(given) != 1:
        raise ValidationError("`structured_outputs` must hold exactly one of "
                              f"{', '.join(k for k in _KINDS if k != 'choices')}; "
                              f"it holds {', '.join(given) or 'none'}")
    kind = given[0]
    field, value = f"structured_outputs.{kind}", spec[kind]
    if kind == "json":
        grammar = _checked(field, JSON, _schema(field, value))
    elif kind == "json_object":
        if value is not True:
            raise ValidationError(f"`{field}` must be true")
        grammar = _checked(field, JSON, {"type": "object"})
    elif kind == "regex":
        grammar = _checked(field, REGEX, value)
    elif kind in ("choice", "choices"):
        grammar = _checked(field, REGEX, choice_pattern(field, value))
    elif kind == "grammar":
        grammar = _checked(field, EBNF, value)
    else:
        grammar = _checked(field, EBNF, structural_tag_grammar(field, value))
    return field, grammar, spec.get("whitespace_pattern")


def _guided(body: dict) -> tuple[str, tuple[str, str]] | None:
    """The guided_* field a body sets, and its grammar."""
    given = [f for f in GUIDED_FIELDS if body.get(f) is not None]
    if len(given) > 1:
        raise ValidationError(f"`{given[0]}` and `{given[1]}` cannot be used together: a request "
                              "takes one constraint")
    if not given:
        return None
    field, value = given[0], body[given[0]]
    if field == "guided_json":
        return field, _checked(field, JSON, _schema(field, value))
    if field == "guided_choice":
        return field, _checked(field, REGEX, choice_pattern(field, value))
    if not isinstance(value, str):
        raise ValidationError(f"`{field}` must be a string")
    return field, _checked(field, REGEX if field == "guided_regex" else EBNF, value)


def _backend(body: dict) -> None:
    backend = body.get("guided_decoding_backend")
    if backend is None:
        return
    name, _, options = backend.partition(":") if isinstance(backend, str) else (None, "", "")
    unknown = [o for o in options.split(",") if o and o not in _BACKEND_OPTIONS]
    if name not in _BACKENDS or unknown:
        raise ValidationError(
            f"`guided_decoding_backend` {str(backend)[:100]!r} is not served: constraints are "
            f"enforced with llguidance (vLLM's `guidance` backend); give one of "
            f"{', '.join(_BACKENDS)}, with options {', '.join(_BACKEND_OPTIONS)} "
            "(`guidance:disable-any-whitespace`), which are how it runs here already")


def _with_whitespace(field: str, grammar: tuple[str, str] | None, pattern) -> tuple[str, str]:
    """A JSON grammar whose whitespace between tokens matches `pattern` (llguidance's option)."""
    if not isinstance(pattern, str):
        raise ValidationError(f"`{field}` must be a string (a regex)")
    if grammar is None or grammar[0] != JSON:
        raise ValidationError(f"`{field}` shapes the whitespace of JSON output: it needs a JSON "
                              "constraint (guided_json, structured_outputs.json, response_format)")
    schema = json.loads(grammar[1])
    schema = {} if schema is True else schema
    if isinstance(schema, dict):
        options = schema.get("x-guidance") or {}
        if not isinstance(options, dict):  # llguidance's options of the schema
            raise ValidationError(f"`{field}` needs the schema's `x-guidance` to be an object "
                                  "(llguidance's options, which the pattern joins)")
        schema = {**schema, "x-guidance": {**options, "whitespace_pattern": pattern}}
    return _checked(field, JSON, schema)


def constraint(body: dict, *, tool_grammar: tuple[str, str] | None = None
               ) -> tuple[str, str] | None:
    """The grammar of `response_format` or vLLM's fields, whichever the body gives.

    `tool_grammar`: the grammar forced tools make, which no other constraint may join. Two
    constraints are a 422 naming both, as vLLM refuses two guided fields."""
    _backend(body)
    given = {"tools": tool_grammar,
             "response_format": structured_output.from_response_format(body.get("response_format"))}
    pattern_field, pattern = "guided_whitespace_pattern", body.get("guided_whitespace_pattern")
    guided = _guided(body)
    if guided is not None:
        given[guided[0]] = guided[1]
    if body.get("structured_outputs") is not None:
        field, grammar, own_pattern = _structured_outputs(body["structured_outputs"])
        given[field] = grammar
        if own_pattern is not None:
            pattern_field, pattern = "structured_outputs.whitespace_pattern", own_pattern
    named = [name for name, grammar in given.items() if grammar is not None]
    if len(named) > 1:
        raise ValidationError(f"`{named[0]}` and `{named[1]}` cannot be used together: a request "
                              "takes one constraint", param=named[1])
    grammar = next((given[n] for n in named if n != "tools"), None)
    if pattern is not None:
        grammar = _with_whitespace(pattern_field, grammar, pattern)
    return grammar
