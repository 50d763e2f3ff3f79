"""Which shards stopped answering (launcher/liveness.py)."""
from launcher.liveness import Liveness


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_shard_silent_past_the_timeout_is_stuck_and_one_that_answers_is_not():
    clock, answering = Clock(), {"/s-0": True, "/s-1": True}
    targets = [(10, "/s-0"), (11, "/s-1")]
    liveness = Liveness(lambda: targets, timeout=30, probe=lambda path, t: answering[path],
                        clock=clock)
    liveness.probe_once()
    answering["/s-1"] = False  # SIGSTOP
    for _ in range(15):
        clock.now += 2
        liveness.probe_once()
    assert liveness.silent_for(10) is None
    assert liveness.silent_for(11) is None  # 30 s: not past the timeout yet
    clock.now += 2
    liveness.probe_once()
    assert liveness.silent_for(11) == 32 and liveness.silent_for(10) is None


def test_new_processes_start_afresh_and_gone_ones_are_forgotten():
    clock = Clock()
    targets = [(10, "/s-0")]
    liveness = Liveness(lambda: targets, timeout=5, probe=lambda path, t: False, clock=clock)
    liveness.probe_once()
    clock.now = 100  # never answered since it was first seen
    assert liveness.silent_for(10) == 100
    targets[:] = [(20, "/s-0")]  # the group was restarted: a new process on the same socket
    liveness.probe_once()
    assert 10 not in liveness.answered and liveness.silent_for(20) is None
    assert liveness.silent_for(99) is None  # never watched
