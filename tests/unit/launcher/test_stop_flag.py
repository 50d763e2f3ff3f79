"""The launcher's stop flag, set by SIGINT/SIGTERM handlers, never deadlocks the watch loop."""
import sys
import threading
from pathlib import Path

from launcher.config import parse_args
from launcher.supervisor import Supervisor


def _watch_stopped_at(line_event: int) -> bool:
    """Whether the supervisor's watch loop returns when a "signal" sets the flag at a given line.

    A signal handler runs in the main thread between any two bytecodes, so the trace function
    plays one: it sets the flag, in the thread running the loop, at the `line_event`-th line the
    loop or the flag executes (threading.Event's own lines among them, where it holds its lock)."""
    supervisor = Supervisor(parse_args(["--model-id", "unused"]), Path("unused"), "unused")
    flag, seen = supervisor.stop_requested, [0]

    def tracer(frame, event, _arg):
        if event == "line" and frame.f_code.co_filename in watched:
            seen[0] += 1
            if seen[0] == line_event:
                flag.set()
        return tracer

    watched = {threading.__file__, sys.modules[type(flag).__module__].__file__,
               sys.modules[Supervisor.__module__].__file__}

    def run():
        sys.settrace(tracer)
        try:
            supervisor._watch()
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=run, daemon=True)  # a deadlocked one is left behind
    worker.start()
    worker.join(5)
    return not worker.is_alive()


def test_a_signal_at_any_line_of_the_watch_loop_stops_it():
    stuck = [n for n in range(1, 16) if not _watch_stopped_at(n)]
    assert not stuck, f"the watch loop deadlocked when the flag was set at line events {stuck}"
