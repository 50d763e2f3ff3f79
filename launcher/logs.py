"""Relays a child's output line by line, prefixed with the child's name or as JSON objects."""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from typing import IO

# the level our children's log format puts after the timestamp
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


def _json_line(source: str, level: str, message: str) -> str:
    return json.dumps({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
                       "level": level, "source": source, "message": message}, ensure_ascii=False)


def format_line(source: str, line: str, *, json_output: bool) -> str:
    if not json_output:
        return f"[{source}] {line}"
    level = _LEVEL.search(line[:40])
    return _json_line(source, level.group(1) if level else "INFO", line)


def say(message: str, *, json_output: bool, level: str = "INFO") -> None:
    """The launcher's own messages, in the same format as the relayed ones."""
    out = _json_line("launcher", level, message) if json_output else f"tgi-launcher: {message}"
    print(out, file=sys.stderr, flush=True)


def relay(stream: IO[bytes], source: str, *, json_output: bool = False,
          tail: list[str] | None = None) -> threading.Thread:
    """Copies `stream` to our stderr; keeps its last lines in `tail` if given."""

    def pump():
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            sys.stderr.write(format_line(source, line, json_output=json_output) + "\n")
            sys.stderr.flush()
            if tail is not None:
                tail.append(line)
                del tail[:-50]
        stream.close()

    thread = threading.Thread(target=pump, name=f"relay-{source}", daemon=True)
    thread.start()
    return thread
