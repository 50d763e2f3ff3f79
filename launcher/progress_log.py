"""A long step of the launcher (a model's download, its conversion) told as log records.

Log records rather than a terminal's progress bar, so that a JSON log gets records too: one when
a stage starts, one per tenth of the way or every few seconds, whichever comes first, and one when
it is done.

    smollm2-135m-instruct: downloading 41 MB / 98 MB (42%)
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("tgi.launcher")

_MB = 10**6


class ProgressLog:
    """A progress callback, `(stage, bytes done, bytes total)`, logging what it is told of `what`.

    Safe to call from several threads."""

    def __init__(self, what: str, *, every_s: float = 5.0, fraction_step: float = 0.1,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what
        self.every_s = every_s
        self.fraction_step = fraction_step
        self.clock = clock
        self.stage: str | None = None
        self.stage_started = 0.0
        self.last_logged_at = 0.0
        self.last_fraction = 0.0
        self.is_stage_done = False
        self.lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            now = self.clock()
            if stage != self.stage:
                self.stage, self.stage_started, self.is_stage_done = stage, now, False
                self.last_fraction = -1.0  # a stage's first report is logged
            if self.is_stage_done:
                return
            fraction = min(done / total, 1.0) if total > 0 else 0.0
            self.is_stage_done = total > 0 and done >= total
            if not (self.is_stage_done or fraction - self.last_fraction >= self.fraction_step
                    or now - self.last_logged_at >= self.every_s):
                return
            self.last_logged_at, self.last_fraction = now, fraction
            self._log(stage, done, total, now - self.stage_started)

    def _log(self, stage: str, done: int, total: int, elapsed: float) -> None:
        fields = {"stage": stage, "what": self.what, "done_bytes": done, "total_bytes": total}
        if total <= 0:  # not known yet
            log.info("%s: %s, %s", self.what, stage, _megabytes(done, done), extra=fields)
        elif self.is_stage_done:
            log.info("%s: %s done, %s in %.1f s", self.what, stage, _megabytes(total, total),
                     elapsed, extra=fields)
        else:
            log.info("%s: %s %s / %s (%d%%)", self.what, stage, _megabytes(done, total),
                     _megabytes(total, total), 100 * done // total, extra=fields)


def _megabytes(size: int, total: int) -> str:
    """`size` in MB, to a tenth where `total` is under 10 MB."""
    return f"{size / _MB:.1f} MB" if total < 10 * _MB else f"{size // _MB} MB"


def directory_size(path: Path) -> int:
    """Bytes of the files under `path`; a file that goes away meanwhile counts for nothing."""
    total = 0
    for file in path.rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:
            pass
    return total


@contextmanager
def watching_size(directory: Path, report: Callable[[int], None], *,
                  every_s: float = 0.5) -> Iterator[None]:
    """A block during which `report` is told the most bytes seen under `directory`.

    It is called every `every_s` seconds while the block runs: the progress of a download that
    another program (pip, huggingface_hub) writes there, and may clear before it ends."""
    finished = threading.Event()

    def watch():
        most = 0
        while not finished.wait(every_s):
            most = max(most, directory_size(directory))
            report(most)

    watcher = threading.Thread(target=watch, name="watching-size", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
