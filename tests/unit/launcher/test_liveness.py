"""Which shards stopped answering (launcher/liveness.py)."""
from launcher.liveness import Liveness


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _liveness(targets, answering, timeout=30):
    clock = Clock()
    return Liveness(lambda: targets, timeout=timeout, probe=lambda path, t: answering[path],
                    clock=clock), clock


def test_a_shard_failing_every_probe_past_the_timeout_is_stuck():
    answering = {"/s-0": True, "/s-1": True}
    liveness, clock = _liveness([(10, "/s-0"), (11, "/s-1")], answering)
    liveness.probe_once()
    answering["/s-1"] = False  # SIGSTOP
    for _ in range(16):
        clock.now += 2
        liveness.probe_once()
    assert liveness.silent_for(10) is None
    assert liveness.silent_for(11) is None  # failing for 30 s: not past the timeout yet
    clock.now += 2
    liveness.probe_once()
    assert liveness.silent_for(11) == 32 and liveness.silent_for(10) is None
    answering["/s-1"] = True  # SIGCONT: one answer clears it
    liveness.probe_once()
    assert liveness.silent_for(11) is None


def test_new_processes_start_afresh_and_gone_ones_are_forgotten():
    targets = [(10, "/s-0")]
    liveness, clock = _liveness(targets, {"/s-0": False}, timeout=5)
    liveness.probe_once()
    clock.now = 6
    liveness.probe_once()
    assert liveness.silent_for(10) == 6
    targets[:] = [(20, "/s-0")]  # the group was restarted: a new process on the same socket
    liveness.probe_once()
    assert 10 not in liveness.failing_since and liveness.silent_for(20) is None
    assert liveness.silent_for(99) is None  # never watched


def test_a_pause_of_the_launcher_itself_restarts_nobody():
    answering = {"/s-0": True}
    liveness, clock = _liveness([(10, "/s-0")], answering, timeout=30)
    liveness.probe_once()
    clock.now += 300  # the launcher was stopped (Ctrl-Z) or its container paused
    assert liveness.silent_for(10) is None
    answering["/s-0"] = False
    liveness.probe_once()  # one failed probe on resuming is no hang yet
    assert liveness.silent_for(10) is None
    clock.now += 100  # and if probing lags behind, nobody is judged
    assert liveness.silent_for(10) is None
