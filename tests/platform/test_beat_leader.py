"""One worker at a time runs the periodic tasks' scheduler; another takes over when it is gone."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from loraplex.platform.tasks.beat import BeatLeader

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class FakeService:
    def __init__(self, log):
        self.log = log
        self.running = False

    def start(self):
        self.running = True
        self.log.append("start")

    def stop(self, wait=False):
        self.running = False
        self.log.append("stop")


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_one_scheduler_at_a_time_and_a_takeover_when_its_worker_is_gone():
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception:
        pytest.skip("no Redis on this machine")
    prefix = f"lpxbeat{uuid.uuid4().hex[:8]}"
    logs: list[list[str]] = [[], [], []]
    leaders = [BeatLeader(client, prefix, lambda i=i: FakeService(logs[i]), lease_seconds=0.6) for i in range(3)]
    try:
        for leader in leaders:
            leader.start()
        assert _wait(lambda: sum(leader.leading for leader in leaders) == 1)
        time.sleep(1.5)  # several lease periods: still exactly one
        assert sum(leader.leading for leader in leaders) == 1
        first = next(leader for leader in leaders if leader.leading)
        # its worker dies without a word: the loop stops renewing (no release), the lease lapses
        first._stop.set()
        first._thread.join()
        first._service = None
        others = [leader for leader in leaders if leader is not first]
        assert _wait(lambda: sum(leader.leading for leader in others) == 1, timeout=5)
        # a worker that stops cleanly hands over at once
        second = next(leader for leader in others if leader.leading)
        second.stop()
        assert logs[leaders.index(second)][-1] == "stop"
        third = next(leader for leader in others if leader is not second)
        assert _wait(lambda: third.leading, timeout=5)
    finally:
        for leader in leaders:
            leader._stop.set()
        client.delete(f"{prefix}:beat-leader")
        client.close()


def test_redis_out_of_reach_is_one_line_not_a_traceback_per_attempt(caplog):
    import logging

    import redis

    client = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    leader = BeatLeader(client, f"lpxbeat{uuid.uuid4().hex[:8]}", lambda: FakeService([]), lease_seconds=0.15)
    with caplog.at_level(logging.DEBUG, logger="loraplex.platform.tasks.beat"):
        leader.start()
        try:
            assert _wait(lambda: sum("failed" in r.getMessage() for r in caplog.records) >= 3)
        finally:
            leader.stop()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(r.exc_info is None for r in warnings), [r.getMessage() for r in warnings]
    failing = [r.getMessage() for r in warnings if "failed" in r.getMessage()]
    assert len(failing) == 1 and "scheduler's lease" in failing[0] and "periodic tasks" in failing[0], failing


def test_a_standby_takes_over_within_30_s_of_the_holders_death():
    """The holder may die just after renewing: its lease lapses LEASE_SECONDS later, and a standby sees that on
    its next look, up to one check interval after. The README promises a takeover within 30 s."""
    from loraplex.platform.tasks.beat import LEASE_SECONDS

    leader = BeatLeader(_NoRedis(), "lpxbeat", lambda: FakeService([]))
    assert leader.lease_seconds == LEASE_SECONDS
    assert leader.lease_seconds + leader.check_seconds <= 30
    # the holder renews several times per lease, so one slow or lost renewal does not cost it the lease
    assert leader.check_seconds <= leader.lease_seconds / 3


class _NoRedis:
    def register_script(self, script):
        return lambda **kwargs: None
