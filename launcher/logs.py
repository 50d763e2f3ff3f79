"""The launcher's log: its own records and its children's output relayed line by line.

Its own records are proto/logs.py's: text, or JSON with --json-output.

A child formats its own records (the launcher tells it how: proto.logs.child_log_environment). In
text, each line is relayed behind the child's name; in JSON, a child's JSON record passes as it
is, and any other line (a C library's print, a crash dump) becomes one record of its own carrying
the child's name as `source`.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
from typing import IO

from proto.logs import configure_logging, json_formatter

log = logging.getLogger("tgi.launcher")

TEXT_FORMAT = "tgi-launcher: %(message)s"
# the logger of a child's line that was no record of its own
RAW_OUTPUT_LOGGER = "tgi.output"
# a level named near the start of a line that is no record (native libraries often say one)
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")

_handler: logging.Handler | None = None


def configure(json_output: bool) -> None:
    """The setup of the launcher's logging on stderr; call once at start.

    The launcher's records from INFO up, and the libraries' from WARNING up (the Hub client logs
    each HTTP request at INFO); say() calls it for a caller that did not."""
    global _handler
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
    _handler = configure_logging(logging.WARNING, json_output=json_output, source="launcher",
                                 text_format=TEXT_FORMAT)
    logging.getLogger("tgi").setLevel(logging.INFO)


def say(message: str, *, json_output: bool, level: str = "INFO") -> None:
    """One of the launcher's own messages."""
    if _handler is None:
        configure(json_output)
    log.log(logging.getLevelName(level), message)


def as_record(source: str, line: str) -> str:
    """A child's line that is no JSON record, as one, in the children's own keys."""
    found = _LEVEL.search(line[:40])
    level = logging.getLevelName(found.group(1)) if found else logging.INFO
    record = logging.LogRecord(RAW_OUTPUT_LOGGER, level, "", 0, line, None, None)
    return json_formatter(source).format(record)


def _json_record(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def relayed_line(source: str, line: str, *, json_output: bool) -> tuple[str, list[str]]:
    """(what the launcher writes for a child's `line`, the lines it keeps of it for its last words).

    The lines kept for the child's last words are a JSON record's message and traceback, as text."""
    if not json_output:
        return f"[{source}] {line}", [line]
    record = _json_record(line)
    if record is None:
        return as_record(source, line), [line]
    said = [str(record.get("message", line))]
    if record.get("exc_info"):
        said += str(record["exc_info"]).splitlines()
    return line, said


def relay(stream: IO[bytes], source: str, *, json_output: bool = False,
          tail: list[str] | None = None) -> threading.Thread:
    """Copies `stream` to our stderr; keeps its last lines in `tail` if given."""

    def pump():
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            out, said = relayed_line(source, line, json_output=json_output)
            sys.stderr.write(out + "\n")
            sys.stderr.flush()
            if tail is not None:
                tail.extend(said)
                del tail[:-50]
        stream.close()

    thread = threading.Thread(target=pump, name=f"relay-{source}", daemon=True)
    thread.start()
    return thread
