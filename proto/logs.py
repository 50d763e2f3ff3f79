"""How tgi-py's processes log on stderr: readable lines, or one JSON object per record.

With --json-output each record is one JSON object, a traceback inside its record (`exc_info`),
with the same keys in the launcher, the router and the shards: timestamp, level, name (the
logger), message, source (the process), and a record's own fields (the access log's status,
tokens...).

Every process formats its own records; tgi-launcher only relays its children's lines. It tells each
child the choice in JSON_OUTPUT (the variable of its own --json-output, which a router or a shard
started by hand reads as well) and the name it relays the child under in TGI_PY_LOG_SOURCE ("router",
"shard 0"), the `source` of the child's records.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

from pythonjsonlogger.json import JsonFormatter

JSON_OUTPUT_ENV = "JSON_OUTPUT"
LOG_SOURCE_ENV = "TGI_PY_LOG_SOURCE"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JSON_KEYS = "%(timestamp)s %(levelname)s %(name)s %(message)s"  # in this order, then the rest


def json_formatter(source: str) -> logging.Formatter:
    return JsonFormatter(_JSON_KEYS, rename_fields={"levelname": "level"},
                         static_fields={"source": source}, timestamp=True,
                         json_ensure_ascii=False)


def is_json_output(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(JSON_OUTPUT_ENV, "").lower() in ("1", "true", "yes")


def log_source(default: str, environ: Mapping[str, str] = os.environ) -> str:
    """The name this process's records carry: the launcher's name for it, else `default`."""
    return environ.get(LOG_SOURCE_ENV) or default


def child_log_environment(*, json_output: bool, source: str) -> dict[str, str]:
    """What tgi-launcher adds to the environment of a child it relays under `source`."""
    return {JSON_OUTPUT_ENV: "true" if json_output else "false", LOG_SOURCE_ENV: source}


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when each record is written (a test's capture replaces it)."""

    def __init__(self, level: int = logging.NOTSET):
        logging.Handler.__init__(self, level)

    @property
    def stream(self):
        return sys.stderr


def configure_logging(level: str | int, *, json_output: bool, source: str,
                      text_format: str = TEXT_FORMAT) -> logging.Handler:
    """Logs every record from `level` up on stderr, as text or as JSON; returns the handler.

    Removing the handler from the root logger undoes this. In JSON an uncaught exception, in the
    main thread or another, is one record too, and so is a Python warning."""
    handler = StderrHandler()
    handler.setFormatter(json_formatter(source) if json_output
                         else logging.Formatter(text_format))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    if json_output:
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    return handler


def _log_uncaught(exc_type, exc_value, traceback, thread: threading.Thread | None = None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc_value, traceback)
        return
    where = f" in thread {thread.name}" if thread is not None else ""
    logging.getLogger("tgi").critical("uncaught exception%s", where,
                                      exc_info=(exc_type, exc_value, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if not issubclass(args.exc_type, SystemExit):  # which ends a thread quietly
        _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback, args.thread)
