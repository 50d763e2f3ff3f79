"""Every grammar form TGI's clients send, and OpenAI's response_format, become the right schema."""
import json

import pytest

from router.errors import ValidationError
from router.inputs.structured_output import (JSON, REGEX, close_objects, from_response_format,
                                            from_tgi)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
AS_SENT = (JSON, json.dumps(close_objects(SCHEMA)))


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": SCHEMA},  # TGI 2.2.1's document
    {"type": "json", "value": json.dumps(SCHEMA)},  # the schema as a string, as TGI takes it
    {"type": "json_object", "value": SCHEMA},  # TGI 3's other name of json
    {"type": "json_schema", "value": {"name": "thing", "schema": SCHEMA}},  # TGI 3's
    {"type": "json_schema", "value": {"schema": SCHEMA}},  # its name is optional
])
def test_each_tgi_form_is_its_schema(grammar):
    assert from_tgi(grammar) == AS_SENT
    assert from_response_format(grammar) == AS_SENT


def test_openais_response_formats():
    assert from_response_format({"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA}}) == AS_SENT
    assert from_response_format({"type": "json_object"}) == (JSON, '{"type": "object"}')
    assert from_response_format({"type": "text"}) is None
    assert from_tgi({"type": "regex", "value": "a+"}) == (REGEX, "a+")


@pytest.mark.parametrize("grammar,words", [
    ({"type": "json_schema", "value": SCHEMA}, "must be an object holding a `schema`"),
    ({"type": "json_schema", "value": "x"}, "must be an object holding a `schema`"),
    ({"type": "ebnf", "value": "x"}, "grammar type 'ebnf' is not supported"),
    ({"type": "json"}, "grammar must be an object with `type`"),
])
def test_a_malformed_grammar_says_what_is_wrong(grammar, words):
    with pytest.raises(ValidationError, match=words):
        from_tgi(grammar)
