"""A chat-template worker: a process of the router's template pool, rendering one job at a time.

Run as `python -m router.inputs.template_worker MAX_STEPS MAX_CHARS MEMORY_BYTES`. It reads jobs
on stdin and answers on stdout, each a frame: a 4-byte big-endian length, then that many bytes. It
first answers READY; a job is JSON {"source": the template, "variables": ...}, and each answer is
one kind byte (PROMPT, ERROR, OVER_BUDGET, OUT_OF_MEMORY) followed by the text in UTF-8.

Its address space is held to what it needed to start plus MEMORY_BYTES, so a template that
allocates past it fails with OUT_OF_MEMORY and the worker exits (the pool starts another). It dies
with the router (PR_SET_PDEATHSIG) and ends when stdin closes.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import struct
import sys
from typing import BinaryIO

from router.errors import TemplateError
from router.inputs.chat_template import ChatTemplate
from router.inputs.template_budget import RenderBudget, TemplateBudgetError

READY, PROMPT, ERROR, OVER_BUDGET, OUT_OF_MEMORY = b"R", b"P", b"E", b"B", b"M"
_LENGTH = struct.Struct(">I")
_CACHED_TEMPLATES = 16  # compiled templates kept: one per model a router serves, in practice
_PR_SET_PDEATHSIG = 1
# below the shards, but not so far that a long legitimate render starves on a busy machine (at 19
# a worker gets about 1.5% of a core beside busy ones; at 10, about 10%)
NICENESS = 10


def encode_job(source: str, variables: dict) -> bytes:
    """A job's bytes (JSON escapes lone surrogates, which a template's text may hold)."""
    return json.dumps({"source": source, "variables": variables}).encode()


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def decode_length(header: bytes) -> int:
    return _LENGTH.unpack(header)[0]


def answer_text(payload: bytes) -> str:
    return payload.decode("utf-8", "surrogatepass")


def _read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    return stream.read(decode_length(header))


def _render(job: bytes, templates: dict[str, ChatTemplate],
            budget: RenderBudget) -> tuple[bytes, str]:
    try:
        request = json.loads(job)
        source = request["source"]
        template = templates.pop(source, None) or ChatTemplate(source, budget=budget)
        templates[source] = template  # the most recently used last
        while len(templates) > _CACHED_TEMPLATES:
            templates.pop(next(iter(templates)))
        return PROMPT, template.render_variables(request["variables"])
    except TemplateBudgetError as err:
        return OVER_BUDGET, err.message
    except TemplateError as err:
        return ERROR, err.message
    except MemoryError:
        return OUT_OF_MEMORY, "the chat template used more memory than a render may"


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: stdin's end still stops an idle worker
        pass


def _limit_memory(extra: int) -> None:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    used = pages * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + extra if hard == resource.RLIM_INFINITY else min(used + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv: list[str]) -> int:
    max_steps, max_chars, memory = (int(a) for a in argv)
    _die_with_parent()
    # a template that spends its whole budget must not take a core from the shards: on a
    # 2-core machine their threads then wait on each other and every stream stalls
    os.nice(NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the router's to handle
    budget = RenderBudget(max_steps=max_steps, max_chars=max_chars)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _limit_memory(memory)
    templates: dict[str, ChatTemplate] = {}
    stdout.write(frame(READY))
    stdout.flush()
    while (job := _read_frame(stdin)) is not None:
        kind, text = _render(job, templates, budget)
        stdout.write(frame(kind + text.encode("utf-8", "surrogatepass")))
        stdout.flush()
        if kind == OUT_OF_MEMORY:
            return 1  # what failed to allocate may have left anything half made
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
