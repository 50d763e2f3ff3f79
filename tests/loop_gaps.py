"""How long the running event loop went without its turn while a block of a test ran: work that
holds the loop (and so every request served on it) shows as a gap as long as itself."""
from __future__ import annotations

import asyncio
import gc
import time


class LoopGaps:
    """`async with LoopGaps() as watch:` ... then `watch.took` (the block's seconds) and
    `watch.longest` (the longest wait of a 1 ms timer on the loop meanwhile)."""

    def __init__(self):
        self.gaps: list[float] = []
        self.took = 0.0
        self._ticker: asyncio.Task | None = None
        self._started = 0.0

    @property
    def longest(self) -> float:
        return max(self.gaps)

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    async def __aenter__(self) -> LoopGaps:
        # what earlier tests left is set aside: a full collection of a whole suite's heap would
        # land in the block as a pause of the interpreter, not of the code under test
        gc.collect()
        gc.freeze()
        self._ticker = asyncio.create_task(self._tick())
        await asyncio.sleep(0.05)
        self._started = time.perf_counter()
        return self

    async def __aexit__(self, *exc) -> None:
        self.took = time.perf_counter() - self._started
        await asyncio.sleep(0.01)  # the ticker notes the gap it was stuck in, if any
        self._ticker.cancel()
        gc.unfreeze()
