"""Which LoRA adapters new requests may name, and how many requests in flight use each.

The generation core admits every request through it; router/lifecycle/adapters.py opens a name
once the shards loaded it and closes it at the start of an unload, which then waits for the
name's count to reach zero before the shards let go of it. Pure: no I/O.
"""
from __future__ import annotations

from collections import Counter

from router.errors import UnknownAdapterError


class AdapterUse:
    def __init__(self) -> None:
        self._open: set[str] = set()
        self.in_flight: Counter[str] = Counter()  # requests admitted and not yet ended, by name

    def open(self, name: str) -> None:
        self._open.add(name)

    def close(self, name: str) -> None:
        """New requests naming `name` are refused from now on; those in flight go on."""
        self._open.discard(name)

    def names(self) -> list[str]:
        return sorted(self._open)

    def check(self, name: str | None) -> None:
        """Raises UnknownAdapterError unless `name` is None (the base model) or open."""
        if name is not None and name not in self._open:
            raise UnknownAdapterError(name, self.names())

    def enter(self, name: str | None) -> None:
        """A request on `name` is admitted (checked first); pair with leave()."""
        self.check(name)
        if name is not None:
            self.in_flight[name] += 1

    def leave(self, name: str | None) -> None:
        if name is not None:
            self.in_flight[name] -= 1
            if self.in_flight[name] <= 0:
                del self.in_flight[name]
