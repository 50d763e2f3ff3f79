"""The router's drain as it stops: requests finish, or past a deadline each ends with a 503.

On SIGTERM every model drains at once, before aiohttp closes the connections, so that no request
is left without an answer: past the deadline a non-streamed request gets a 503 in its API's shape,
a stream its error event, a gRPC call UNAVAILABLE, and the handlers get FLUSH_TIMEOUT_S to write
them. (A model stopped through the API drains alone: manager.py.)
"""
from __future__ import annotations

import asyncio
import logging

from router.errors import UnhealthyError
from router.lifecycle.served_model import ServedModel

log = logging.getLogger("tgi.router")

POLL_S = 0.05  # how often a drain looks whether the requests are done
# seconds the handlers get after the drain to write the answers it gave them (a 503 is written in
# milliseconds; this bounds a handler that is not a generation's)
FLUSH_TIMEOUT_S = 1.0


def shutting_down() -> UnhealthyError:
    return UnhealthyError("the server is shutting down and ended the request before it finished; "
                          "try again")


async def wait_until_idle(served: ServedModel, timeout: float) -> int:
    """Waits until no request of the model is validated, generated or written, at most `timeout` s.

    A stream whose generation ended is waited for too, while its client reads the rest. Returns
    how many requests are still generating then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not served.infer.is_idle and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    return served.infer.in_flight


async def drain_for_shutdown(models: list[ServedModel], timeout: float) -> None:
    """The router is stopping: requests get `timeout` s to finish, then the rest end with a 503.

    The same 503 answers a request that was still being validated and reaches a model later.
    """
    left = await asyncio.gather(*(wait_until_idle(served, timeout) for served in models))
    for served, count in zip(models, left):
        if count:
            log.warning("%s: %d requests still running after the %g s drain; each ends with a "
                        "503 (a stream with an error event)", served.model_name, count, timeout)
        await served.end_requests(shutting_down(), refusal=shutting_down)
