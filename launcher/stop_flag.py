"""Whether the launcher is stopping: set from signal handlers and any thread, read by all."""
from __future__ import annotations


class StopFlag:
    """A flag with threading.Event's set/is_set, taking no lock.

    The SIGINT/SIGTERM handler sets it, and a Python signal handler runs in the main thread between
    any two bytecodes, possibly while that thread holds a lock. threading.Event.set takes the
    event's own lock, which the main thread holds on its way into and out of Event.wait: a signal
    arriving there deadlocked the launcher, which then never stopped its children. A plain
    attribute written under the GIL needs no lock; waiters poll it.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set
