"""Ends a router or shard started by tgi-launcher when the launcher ends, however it ended.

Children run in sessions of their own (a Ctrl-C reaches the launcher alone, which stops them in
order), so a launcher killed with SIGKILL would leave them serving with nobody to restart a shard
that died, holding the port and sockets a new launcher needs. Each child watches for the
launcher's pid to stop being its parent, and then stops itself as SIGTERM stops it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("tgi.launcher_watch")

LAUNCHER_PID_ENV = "TGI_PY_LAUNCHER_PID"  # set by the launcher in each child's environment


def watch_launcher(*, every: float = 1.0, grace: float = 30.0) -> threading.Thread | None:
    """Starts a daemon thread that stops this process once the launcher that started it is gone.

    The thread sends SIGTERM when that happens (this process was handed to another parent), and ends
    the process `grace` seconds later if the SIGTERM did not. None when no launcher started this
    process."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not launcher.isdigit():
        return None
    thread = threading.Thread(target=_watch, args=(int(launcher), every, grace),
                              name="launcher-watch", daemon=True)
    thread.start()
    return thread


def _watch(launcher: int, every: float, grace: float) -> None:
    while os.getppid() == launcher:
        time.sleep(every)
    log.error("tgi-launcher (pid %d) is gone: stopping", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    log.error("still running %g s after tgi-launcher went: exiting", grace)
    os._exit(1)
