"""Request fields a route does not read: ignored, and each name logged once.

vLLM's and SGLang's servers ignore fields they do not know (newer clients send newer fields); the
log says which were ignored without repeating itself. Clients choose the names, so at most `limit`
are remembered, each cut to 100 characters (a body's one key may be megabytes).
"""
from __future__ import annotations

import logging

log = logging.getLogger("tgi.router")

NAME_CHARS = 100


class UnknownFields:
    """The names already logged; `why`: what the log line says of ignoring them."""

    def __init__(self, why: str, limit: int = 1024):
        self.why = why
        self.limit = limit
        self.warned: set[str] = set()

    def note(self, name: str, route: str) -> None:
        """Logs `name`, a field `route` ignores, unless it was logged before."""
        name = name[:NAME_CHARS]
        if name in self.warned or len(self.warned) >= self.limit:
            return
        self.warned.add(name)
        log.warning("%s: ignored the request field %r, which this server does not read (%s; "
                    "logged once per field name)", route, name, self.why)

    def check(self, body: dict, known: frozenset, route: str) -> list[str]:
        """The names in `body` that `known` lacks, each noted."""
        unknown = [name for name in body if name not in known]
        for name in unknown:
            self.note(name, route)
        return unknown
