"""A shard SIGKILLed under load: the router stays up, the launcher restarts the whole group, the
router warms it up again and serves the same answers; past the restart budget the launcher exits."""
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server import free_and_total_blocks, launch
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

PROMPT = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12}}


def _stream(url: str, i: int) -> dict:
    """One long stream: how it ended (a final event, an SSE error event, or an HTTP status)."""
    body = {"inputs": f"Stream number {i}", "parameters": {"max_new_tokens": 400}}
    try:
        with requests.post(f"{url}/generate_stream", json=body, stream=True, timeout=120) as reply:
            if reply.status_code != 200:
                return {"status": reply.status_code, "body": reply.text}
            for line in reply.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return {"status": 200, "error": event}
                if event.get("generated_text") is not None:
                    return {"status": 200, "final": event}
            return {"status": 200, "ended_without_final": True}
    except requests.RequestException as err:
        return {"status": None, "exception": repr(err)}


def _metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_for_health(url: str, status: int, deadline_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == status:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status} within {deadline_s} s")


def test_killed_rank_restarts_the_group_and_the_router_serves_again(tiny_llama, tmp_path):
    server = launch(["--model-id", str(tiny_llama)], tmp_path,
                    extra=["--num-shard", "2", "--max-batch-total-tokens", "8192",
                           "--max-shard-restarts", "1", "--shard-recovery-timeout", "120"])
    pool = ThreadPoolExecutor(8)
    try:
        url = server.url
        before = requests.post(f"{url}/generate", json=PROMPT, timeout=60).json()
        streams = [pool.submit(_stream, url, i) for i in range(4)]
        wait_until(lambda: _metric(url, "tgi_batch_current_size") > 0,
                   "the streams to be running", timeout=30)
        old_pids = server.shard_pids()
        os.kill(old_pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        # sent while the shards are away: it waits in the queue and is served once they are back
        waiting = pool.submit(lambda: requests.post(f"{url}/generate", json=PROMPT, timeout=150))
        _wait_for_health(url, 503, deadline_s=30)
        _wait_for_health(url, 200, deadline_s=150)
        reply = waiting.result(timeout=150)
        recovery_s = time.monotonic() - killed_at
        assert reply.status_code == 200, reply.text
        assert reply.json() == before, "the restarted group answers as the first did"

        ended = [s.result(timeout=150) for s in streams]
        for outcome in ended:
            # finished before the kill, or an SSE error event: never a hang or a silent end
            assert "final" in outcome or outcome.get("error", {}).get("error_type") == \
                "generation", outcome
        assert any("error" in o for o in ended), ended

        new_pids = server.shard_pids()
        assert set(new_pids) == {0, 1} and not set(new_pids.values()) & set(old_pids.values()), \
            "every rank was restarted"
        assert requests.post(f"{url}/generate", json=PROMPT, timeout=60).json() == before
        free, total = free_and_total_blocks(url)
        assert free == total, "no KV block leaked"
        assert re.search(r"restarting the shard group of \S+ \(restart 1 of 1", server.log())
        print(f"recovery: SIGKILL -> first 200 in {recovery_s:.1f} s")

        # the budget is one restart: the next death ends everything, with a non-zero exit
        os.kill(new_pids[0], signal.SIGKILL)
        code = server.process.wait(timeout=60)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if server.process.poll() is None:
            server.stop()
    assert code != 0
    assert "--max-shard-restarts 1 is used up" in server.log()
    deadline = time.monotonic() + 10
    while server.processes_left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.processes_left() == []


def test_a_stopped_rank_is_restarted_as_if_it_had_died(tiny_llama, tmp_path):
    """A rank that hangs (here SIGSTOP) does not exit: past --shard-hang-timeout without answering
    its health check, its group is restarted, the stream on it ends with an error frame, and the
    request waiting behind it is served by the new group."""
    server = launch(["--model-id", str(tiny_llama)], tmp_path,
                    extra=["--num-shard", "2", "--max-batch-total-tokens", "8192",
                           "--shard-hang-timeout", "4", "--shard-recovery-timeout", "120"])
    pool = ThreadPoolExecutor(4)
    stopped = None
    try:
        url = server.url
        before = requests.post(f"{url}/generate", json=PROMPT, timeout=60).json()
        stream = pool.submit(_stream, url, 0)
        wait_until(lambda: _metric(url, "tgi_batch_current_size") > 0,
                   "the stream to be running", timeout=30)
        old_pids = server.shard_pids()
        stopped = old_pids[1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        waiting = pool.submit(lambda: requests.post(f"{url}/generate", json=PROMPT, timeout=150))
        reply = waiting.result(timeout=150)
        assert reply.status_code == 200, reply.text
        assert reply.json() == before
        waited = time.monotonic() - stopped_at
        outcome = stream.result(timeout=60)
        assert "final" in outcome or outcome.get("error", {}).get("error_type") == \
            "generation", outcome
        new_pids = server.shard_pids()
        assert not set(new_pids.values()) & set(old_pids.values()), "every rank was restarted"
        assert "shard 1 has not answered its health check for" in server.log()
        assert waited < 60, f"the waiting request took {waited:.0f} s"
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)  # in case the launcher did not
            except ProcessLookupError:
                pass
        pool.shutdown(wait=False, cancel_futures=True)
        code = server.stop()
    assert code == 0, server.log()
