"""Validates JSON bodies against the schemas of TGI's OpenAPI document (../shared/spec).

Without the document (a checkout with no ../shared beside it) nothing is validated, and it shows:
a test that would have checked a body still runs its own assertions to the end, and if they pass
it is reported as skipped with the missing file named (tests/conftest.py turns `unchecked` into
that skip), so `pytest -rs` and the summary's skip count tell that the schemas went unchecked."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec" / "tgi-openapi-2.2.1.json"

# the schemas the running test could not check for want of SPEC (cleared before each test)
unchecked: set[str] = set()


def _to_json_schema(node):
    """OpenAPI 3.0's `nullable` -> JSON Schema's null type, recursively."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _to_json_schema(v) for k, v in node.items() if k not in ("example", "default")}
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


def validator(schema_name: str):
    if not SPEC.exists():
        pytest.skip(f"{SPEC} is missing (TGI's OpenAPI document, beside the checkout)")
    import jsonschema

    spec = json.loads(SPEC.read_text())
    root = {"components": _to_json_schema(copy.deepcopy(spec["components"])),
            "$ref": f"#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(root)


def assert_matches(schema_name: str, body) -> None:
    """Checks `body` against TGI's schema when the spec is beside the checkout (as in CI). Without
    it the calling test goes on with its own assertions, and is reported as skipped, naming the
    missing file, if they pass."""
    if not SPEC.exists():
        unchecked.add(schema_name)
        return
    errors = sorted(validator(schema_name).iter_errors(body), key=str)
    assert not errors, f"{schema_name}: {errors[0].message} at {list(errors[0].absolute_path)}"


def answer_problems(document: dict, path: str, method: str, reply) -> list[str]:
    """What in `reply` (a requests.Response to `method` `path`) our served `document` does not say.

    The schema is the one the document gives for the reply's status and content type; a JSON body
    is checked whole, an event stream event by event (its `data: [DONE]` aside), newline-delimited
    JSON line by line, text as a string.
    A status or content type the document does not list is a problem too."""
    import jsonschema

    responses = document["paths"][path][method]["responses"]
    where = f"{method.upper()} {path} -> {reply.status_code}"
    if str(reply.status_code) not in responses:
        return [f"{where}: status not in the document"]
    content = responses[str(reply.status_code)].get("content")
    if content is None:
        return []  # a status with no body documented (GET /health's 200)
    kind = reply.headers.get("content-type", "").split(";")[0].strip()
    if kind not in content:
        return [f"{where}: content type {kind!r} not in the document ({sorted(content)})"]
    root = {"components": _to_json_schema(document["components"]),
            **_to_json_schema(content[kind]["schema"])}
    check = jsonschema.Draft202012Validator(root)
    if kind == "text/event-stream":
        bodies = [json.loads(line[5:]) for line in reply.text.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        if not bodies:
            return [f"{where}: an event stream of no events"]
    elif kind == "application/x-ndjson":  # Ollama's streams: a JSON object a line
        bodies = [json.loads(line) for line in reply.text.splitlines() if line.strip()]
    elif kind == "application/json":
        bodies = [reply.json()]
    else:
        bodies = [reply.text]
    return [f"{where}: {error.message} at {list(error.absolute_path)}"
            for body in bodies for error in check.iter_errors(body)]
