"""The launcher stops everything and exits non-zero, naming the child, when a shard dies."""
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.server import launch

pytestmark = pytest.mark.e2e


def _shard_pid(uds_path: str) -> int:
    found = subprocess.run(["pgrep", "-f", f"shard --model-path .* --uds-path {uds_path}"],
                           capture_output=True, text=True)
    return int(found.stdout.split()[0])


def test_dead_shard_stops_the_launcher_with_a_message(tiny_llama, tmp_path):
    server = launch(["--model-id", str(tiny_llama)], tmp_path,
                    extra=["--max-batch-total-tokens", "4096"])
    try:
        os.kill(_shard_pid(server.uds_path), signal.SIGKILL)
        code = server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.stop()
    assert code != 0
    assert "shard 0 exited with code -9" in server.log()
    deadline = time.monotonic() + 10
    while server.processes_left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.processes_left() == []
    assert not os.path.exists(f"{server.uds_path}-0")


def test_heads_that_do_not_divide_fail_before_any_process_starts(tiny_llama, tmp_path):
    done = subprocess.run([os.sys.executable, "-m", "launcher", "--model-id", str(tiny_llama),
                           "--num-shard", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "--num-shard 3 does not divide" in done.stderr
    assert "[shard" not in done.stderr
