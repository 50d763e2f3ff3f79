"""A launcher's child ends when the launcher does, however it ended (proto/launcher_watch.py)."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from proto import launcher_watch
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]

_CHILD = textwrap.dedent("""
    import signal, sys, time
    from proto.launcher_watch import watch_launcher
    def stop(*args):
        print("stopping in order", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    watch_launcher(every=0.05)
    print("watching", flush=True)
    time.sleep(60)
""")

# stands for tgi-launcher: starts the child as it does, says the child's pid, then waits
_LAUNCHER = textwrap.dedent(f"""
    import os, subprocess, sys, time
    env = {{**os.environ, {launcher_watch.LAUNCHER_PID_ENV!r}: str(os.getpid())}}
    child = subprocess.Popen([sys.executable, "-c", {_CHILD!r}], env=env,
                             stdout=open(sys.argv[1], "w"), start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie whose new parent has not reaped it yet has ended


def test_a_child_stops_in_order_once_its_launcher_is_killed(tmp_path):
    log = tmp_path / "child.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(log)], env=env,
                                stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        wait_until(lambda: "watching" in log.read_text(), "the child to watch its launcher",
                   timeout=30)
        assert not _ended(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while not _ended(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ended(child), "the child outlived its launcher"
        assert "stopping in order" in log.read_text()  # by SIGTERM's handler, not killed
    finally:
        launcher.kill()
        launcher.wait()
        if "child" in locals() and not _ended(child):
            os.kill(child, signal.SIGKILL)


def test_a_process_the_launcher_did_not_start_watches_nothing(monkeypatch):
    monkeypatch.delenv(launcher_watch.LAUNCHER_PID_ENV, raising=False)
    assert launcher_watch.watch_launcher() is None
    monkeypatch.setenv(launcher_watch.LAUNCHER_PID_ENV, "not a pid")
    assert launcher_watch.watch_launcher() is None
