"""Relays a child's output line by line with a prefix naming the child."""
from __future__ import annotations

import sys
import threading
from typing import IO


def relay(stream: IO[bytes], prefix: str, *, tail: list[str] | None = None) -> threading.Thread:
    """Copies `stream` to our stderr as '[prefix] line'; keeps the last lines in `tail` if given."""

    def pump():
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            sys.stderr.write(f"[{prefix}] {line}\n")
            sys.stderr.flush()
            if tail is not None:
                tail.append(line)
                del tail[:-50]
        stream.close()

    thread = threading.Thread(target=pump, name=f"relay-{prefix}", daemon=True)
    thread.start()
    return thread
