"""--json-output end to end: every process writes its own JSON records (the launcher relays them),
and each request gets its access-log record from the router."""
import json

import pytest
import requests

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e


def test_every_line_is_a_json_record_and_a_request_has_its_access_record(tiny_llama, tmp_path):
    server = launch(["--model-id", str(tiny_llama)], tmp_path,
                    extra=["--json-output", "--max-batch-total-tokens", "4096"])
    try:
        reply = requests.post(f"{server.url}/generate", timeout=60,
                              json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                              headers={"x-request-id": "e2e-json-1"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "e2e-json-1"
    finally:
        code = server.stop()
    assert code == 0, server.log()[-5000:]
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert {"launcher", "router", "shard 0"} <= {r["source"] for r in records}
    assert all({"timestamp", "level", "name", "message", "source"} <= set(r) for r in records)
    (access,) = [r for r in records if r["name"] == "tgi.access"]
    assert access["source"] == "router" and access["request_id"] == "e2e-json-1"
    assert (access["method"], access["path"], access["status"]) == ("POST", "/generate", 200)
    assert access["generated_tokens"] == 4 and access["input_tokens"] > 0
    assert access["model"] == str(tiny_llama)
