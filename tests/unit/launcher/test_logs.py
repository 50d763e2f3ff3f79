"""The launcher's log: its own messages, and its children's lines relayed (a JSON record as it is,
any other line made one record) with each child told how to log."""
import json
import os

import pytest

from launcher import logs, shard_group
from launcher.logs import relay, say
from proto.logs import JSON_OUTPUT_ENV, LOG_SOURCE_ENV
from tests.unit.logging_helpers import process_logging_undone

RECORD = json.dumps({"timestamp": "2025-01-01T00:00:00+00:00", "level": "ERROR",
                     "name": "tgi.shard", "message": "step failed", "source": "shard 0",
                     "exc_info": "Traceback (most recent call last):\n  ...\nKeyError: 'x'",
                     "status": 200}, ensure_ascii=False)


def _relayed(lines: list[str], *, json_output: bool, capsys) -> tuple[list[str], list[str]]:
    """(what the launcher wrote for the child's `lines`, the child's last lines kept)."""
    read, write = os.pipe()
    os.write(write, "".join(line + "\n" for line in lines).encode())
    os.close(write)
    tail: list[str] = []
    relay(os.fdopen(read, "rb"), "shard 0", json_output=json_output, tail=tail).join(timeout=10)
    return capsys.readouterr().err.splitlines(), tail


def test_a_childs_json_record_passes_as_it_is_and_any_other_line_becomes_one(capsys):
    written, tail = _relayed([RECORD, "NCCL ERROR something broke", "plain print é", "[1, 2]"],
                             json_output=True, capsys=capsys)
    assert written[0] == RECORD
    wrapped = [json.loads(line) for line in written[1:]]
    assert [(r["level"], r["message"]) for r in wrapped] == [
        ("ERROR", "NCCL ERROR something broke"), ("INFO", "plain print é"), ("INFO", "[1, 2]")]
    assert all(r["source"] == "shard 0" and r["name"] == "tgi.output" and r["timestamp"]
               for r in wrapped)
    # a death names the child's last words as text, the traceback with them
    assert tail[:4] == ["step failed", "Traceback (most recent call last):", "  ...",
                        "KeyError: 'x'"]


def test_text_lines_are_relayed_behind_the_childs_name(capsys):
    written, tail = _relayed(["2025 INFO tgi.shard: loaded", RECORD], json_output=False,
                             capsys=capsys)
    assert written == ["[shard 0] 2025 INFO tgi.shard: loaded", f"[shard 0] {RECORD}"]
    assert tail == ["2025 INFO tgi.shard: loaded", RECORD]


@pytest.mark.parametrize("json_output", [False, True])
def test_the_launchers_own_messages(capsys, monkeypatch, json_output):
    monkeypatch.setattr(logs, "_handler", None)
    with process_logging_undone():
        say("serving m", json_output=json_output)
        say("shard 1 did not stop", json_output=json_output, level="WARNING")
    lines = capsys.readouterr().err.splitlines()
    if not json_output:
        assert lines == ["tgi-launcher: serving m", "tgi-launcher: shard 1 did not stop"]
        return
    records = [json.loads(line) for line in lines]
    assert [(r["level"], r["source"], r["message"]) for r in records] == [
        ("INFO", "launcher", "serving m"), ("WARNING", "launcher", "shard 1 did not stop")]


@pytest.mark.parametrize("json_output", [False, True])
def test_each_child_is_told_how_to_log_and_its_name(monkeypatch, json_output):
    started = []

    class Started:
        def __init__(self, argv, env, **kwargs):
            started.append(env)
            self.stdout = open(os.devnull, "rb")

    monkeypatch.setattr(shard_group.subprocess, "Popen", Started)
    shard_group.spawn("model 1 shard 0", ["true"], {JSON_OUTPUT_ENV: "true"}, json_output)
    assert started[0][JSON_OUTPUT_ENV] == ("true" if json_output else "false")
    assert started[0][LOG_SOURCE_ENV] == "model 1 shard 0"
