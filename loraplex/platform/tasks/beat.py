"""The periodic tasks' scheduler (Celery beat) inside `loraplex worker`, run by one worker at a time.

Celery's `--beat` starts the scheduler as a child process: a worker killed with SIGKILL leaves it running,
orphaned, and every replica runs its own, so each periodic task went out once per worker (and once more per
orphan). Here the scheduler is a thread of the worker process (it dies with it), and it runs only in the
worker that holds a lease in Redis: the others wait, and take over within a lease when the holder is gone.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from loraplex.platform.outage import OutageLog

log = logging.getLogger(__name__)

# A worker that dies leaves its lease to lapse; a standby notices on its next look, CHECKS_PER_LEASE of which
# fit in a lease. A takeover comes within LEASE_SECONDS * (1 + 1 / CHECKS_PER_LEASE) of the death: 25 s, inside
# the 30 s the README promises. The holder renews as often, so it keeps the lease through 15 s without Redis.
LEASE_SECONDS = 20
CHECKS_PER_LEASE = 4

# KEYS: lease key. ARGV: holder id, lease ms. Take the lease if free, extend it if ours; 1 when we hold it.
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease key. ARGV: holder id. Give the lease back if ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BeatLeader:
    """Runs `make_service()`'s scheduler while this process holds the lease; stops it when it loses it."""

    def __init__(self, redis_client, prefix: str, make_service: Callable[[], object], *,
                 lease_seconds: float = LEASE_SECONDS):
        self.redis = redis_client
        self.key = f"{prefix}:beat-leader"
        self.me = uuid.uuid4().hex
        self.make_service = make_service
        self.lease_seconds = lease_seconds
        self._hold = redis_client.register_script(_HOLD)
        self._release = redis_client.register_script(_RELEASE)
        self._outage = OutageLog(log, "reaching Redis for the scheduler's lease", round(self.check_seconds, 1),
                                 ", so this worker runs no periodic tasks")
        self._stop = threading.Event()
        self._service = None
        self._thread: threading.Thread | None = None

    @property
    def check_seconds(self) -> float:
        """How often the holder renews its lease and a standby looks whether it is free."""
        return self.lease_seconds / CHECKS_PER_LEASE

    @property
    def leading(self) -> bool:
        return self._service is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="beat-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_seconds)
        self._step_down()
        try:
            self._release(keys=[self.key], args=[self.me])
        except Exception as exc:
            log.warning("could not give the scheduler's lease back (%s); it lapses by itself", exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                held = bool(self._hold(keys=[self.key], args=[self.me, int(self.lease_seconds * 1000)]))
            except Exception as exc:  # one line when it starts failing and one when it works again
                self._outage.failed(exc)
                held = False  # another worker may hold it by now: better no scheduler than two
            else:
                self._outage.ok()
            if held and self._service is None:
                log.info("this worker runs the periodic tasks' scheduler")
                self._service = self.make_service()
                threading.Thread(target=self._service.start, name="beat", daemon=True).start()
            elif not held:
                self._step_down()
            self._stop.wait(self.check_seconds)

    def _step_down(self) -> None:
        if self._service is not None:
            log.info("this worker no longer runs the periodic tasks' scheduler")
            self._service.stop()
            self._service = None


def start_beat(app, settings, schedule_filename: str) -> BeatLeader:
    """The worker's scheduler leader, started once the worker is ready: by then Celery has set up the logging,
    so the line saying this worker took the scheduler reaches the worker's log."""
    from celery.beat import Service
    from celery.signals import worker_ready

    from loraplex.platform.redis_clients import sync_redis

    leader = BeatLeader(sync_redis(settings), settings.redis_prefix,
                        lambda: Service(app, schedule_filename=schedule_filename))
    worker_ready.connect(lambda **_: leader.start(), weak=False)
    return leader
