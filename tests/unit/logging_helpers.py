"""Process logging (proto/logs.py) configured inside a test, and everything it set undone after."""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def process_logging_undone() -> Iterator[None]:
    """Undoes, when the block ends, what configure_logging sets: the root logger's handlers and
    level, the exception hooks, the capture of warnings; and what the launcher's own setup sets
    (its handler, the level of the "tgi" loggers). tests/conftest.py wraps every test in it:
    a launcher run in the test's process would leave its handler to the tests after it."""
    from launcher import logs as launcher_logs

    root, ours = logging.getLogger(), logging.getLogger("tgi")
    handlers, level, our_level = list(root.handlers), root.level, ours.level
    launcher_handler = launcher_logs._handler
    hooks = sys.excepthook, threading.excepthook
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
        ours.setLevel(our_level)
        launcher_logs._handler = launcher_handler
        sys.excepthook, threading.excepthook = hooks
        logging.captureWarnings(False)
