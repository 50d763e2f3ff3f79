"""Waiting for a condition instead of sleeping a fixed time: a test that needs a request running
(or any other state) before its next step polls for that state, up to a deadline, and fails
saying what never happened."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def _failure(what: str, timeout: float, last: Any) -> AssertionError:
    return AssertionError(f"waited {timeout:g} s for {what}; it never happened (last seen: "
                          f"{last!r})")


def wait_until(condition: Callable[[], Any], what: str, *, timeout: float = 30.0,
               every: float = 0.02) -> Any:
    """Calls `condition` every `every` seconds until it returns something true, and returns
    that; past `timeout` seconds, fails naming `what` was waited for. For tests whose work runs
    in other threads or processes (it blocks the calling thread)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, value)
        time.sleep(every)


async def wait_until_async(condition: Callable[[], Any], what: str, *, timeout: float = 5.0,
                           every: float = 0.001) -> Any:
    """As wait_until, on the running event loop: sleeps (asyncio) between calls, so the tasks
    the test waits on run meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if loop.time() >= deadline:
            raise _failure(what, timeout, value)
        await asyncio.sleep(every)
