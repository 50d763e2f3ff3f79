"""How a process logs (proto/logs.py): text as before, or with JSON_OUTPUT one JSON object per
record, a traceback inside its record, the process named by the launcher as `source`."""
import json
import logging
import os
import subprocess
import sys
import threading
import warnings

from proto.logs import (JSON_OUTPUT_ENV, LOG_SOURCE_ENV, child_log_environment, configure_logging,
                        is_json_output, log_source)
from tests.unit.logging_helpers import process_logging_undone


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_a_traceback_is_inside_one_json_record(capsys):
    with process_logging_undone():
        configure_logging("INFO", json_output=True, source="shard 1")
        log = logging.getLogger("tgi.shard")
        log.debug("below the level")
        try:
            {}["missing"]
        except KeyError:
            log.exception("step %d failed", 7)
        log.info("served", extra={"status": 200})
    (failed, served) = _records(capsys.readouterr().err)
    assert list(failed)[:5] == ["timestamp", "level", "name", "message", "source"]
    assert (failed["level"], failed["name"], failed["message"], failed["source"]) == \
        ("ERROR", "tgi.shard", "step 7 failed", "shard 1")
    assert failed["exc_info"].startswith("Traceback (most recent call last):")
    assert failed["exc_info"].endswith("KeyError: 'missing'")
    assert served["status"] == 200 and "exc_info" not in served


def test_uncaught_exceptions_and_warnings_are_records_too(capsys):
    with process_logging_undone():
        configure_logging("INFO", json_output=True, source="router")
        thread = threading.Thread(target=lambda: 1 / 0, name="worker")
        thread.start()
        thread.join()
        try:
            raise RuntimeError("the end")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
        warnings.warn("an old flag", DeprecationWarning, stacklevel=1)
    in_thread, in_main, warned = _records(capsys.readouterr().err)
    assert in_thread["message"] == "uncaught exception in thread worker"
    assert in_thread["level"] == "CRITICAL" and "ZeroDivisionError" in in_thread["exc_info"]
    assert in_main["message"] == "uncaught exception" and "RuntimeError: the end" in \
        in_main["exc_info"]
    assert warned["name"] == "py.warnings" and "an old flag" in warned["message"]


def test_text_stays_as_it_was(capsys):
    with process_logging_undone():
        configure_logging("INFO", json_output=False, source="router")
        logging.getLogger("tgi.router").warning("careful")
        hook = sys.excepthook
    line = capsys.readouterr().err
    assert line.endswith(" WARNING tgi.router: careful\n") and line.count("\n") == 1
    assert getattr(hook, "__module__", "") != "proto.logs", "text keeps Python's own hooks"


def test_the_launcher_tells_each_child_how_and_under_which_name():
    env = child_log_environment(json_output=True, source="model 2 shard 1")
    assert is_json_output(env) and log_source("shard", env) == "model 2 shard 1"
    text = child_log_environment(json_output=False, source="router")
    assert not is_json_output(text) and text[JSON_OUTPUT_ENV] == "false"
    assert log_source("shard", {}) == "shard" and not is_json_output({})


def test_the_router_logs_a_fatal_error_as_one_json_record(tmp_path):
    """The real process: no shard answers on its socket, and it ends on the error."""
    env = {**os.environ, JSON_OUTPUT_ENV: "true", LOG_SOURCE_ENV: "router"}
    done = subprocess.run([sys.executable, "-m", "router", "--tokenizer-path", str(tmp_path),
                           "--master-shard-uds-path", str(tmp_path / "nobody")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0
    records = _records(done.stderr)  # every line is a JSON object
    assert all(r["source"] == "router" for r in records)
    (fatal,) = [r for r in records if "exc_info" in r]
    assert fatal["level"] == "CRITICAL" and "ShardError" in fatal["exc_info"]
    assert fatal["exc_info"].count("\n") > 5, "the whole traceback, in the one record"
