"""An engine whose Redis goes away logs one line when its heartbeat starts failing and one when it is
restored, not a traceback every two seconds, and registers again as soon as Redis is back."""

from __future__ import annotations

import asyncio
import json
import logging

from fake_engine import FakeEngine

from loraplex.config import Settings
from loraplex.platform.remote import server


class FlakyRedis:
    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0
        self.stored: dict[str, dict] = {}

    async def set(self, key, value, ex=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        self.stored[key] = json.loads(value)


class DeletingRedis(FlakyRedis):
    def __init__(self, failures: int):
        super().__init__(failures)
        self.deleted: list[str] = []

    async def delete(self, key):
        self.deleted.append(key)
        self.stored.pop(key, None)


def test_heartbeat_logs_the_outage_once_and_its_end(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(server, "HEARTBEAT_SECONDS", 0)
    redis = FlakyRedis(failures=5)
    settings = Settings(data_dir=tmp_path, redis_prefix="hb-test")

    async def run():
        task = asyncio.create_task(server._heartbeat(redis, settings, FakeEngine(), "e1", "http://e1:1"))
        while not redis.stored:
            await asyncio.sleep(0)
        task.cancel()

    with caplog.at_level(logging.DEBUG, logger=server.log.name):
        asyncio.run(run())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    assert "heartbeat failed" in warnings[0].getMessage() and "Connection refused" in warnings[0].getMessage()
    assert warnings[0].exc_info is None
    assert "restored" in warnings[1].getMessage()
    (record,) = redis.stored.values()
    assert record["engine_id"] == "e1" and record["url"] == "http://e1:1"
    assert {"kv_blocks_total", "lora_slots_total", "lora_pinned"} <= record["stats"].keys()  # the whole snapshot


def test_a_draining_engine_withdraws_its_registration_at_once(tmp_path):
    """Told to stop, the engine leaves the registry before it drains (API processes then send new requests
    elsewhere) rather than staying listed until its running requests finish."""
    import threading

    redis = DeletingRedis(failures=0)
    settings = Settings(data_dir=tmp_path, redis_prefix="hb-test")
    draining = threading.Event()

    async def run():
        task = asyncio.create_task(server._heartbeat(redis, settings, FakeEngine(), "e1", "http://e1:1", draining))
        while not redis.stored:
            await asyncio.sleep(0)
        draining.set()
        await asyncio.wait_for(task, timeout=60)  # returns by itself, well before the next beat is due

    asyncio.run(run())
    assert redis.deleted == [server.registry_key("hb-test", "e1")] and not redis.stored


def test_an_engine_whose_step_thread_stopped_withdraws_its_registration(tmp_path, caplog):
    """An engine process that can no longer serve leaves the registry, so API processes route elsewhere
    (or answer 503) instead of sending every request to it."""
    redis = DeletingRedis(failures=0)
    settings = Settings(data_dir=tmp_path, redis_prefix="hb-test")
    engine = FakeEngine()

    exits = []

    async def run():
        task = asyncio.create_task(server._heartbeat(redis, settings, engine, "e1", "http://e1:1",
                                                     on_engine_failure=lambda: exits.append(list(redis.deleted))))
        while not redis.stored:
            await asyncio.sleep(0)
        engine.failure = "SystemError in its step thread (the server log has the cause)"
        await asyncio.wait_for(task, timeout=60)

    with caplog.at_level(logging.INFO, logger=server.log.name):
        asyncio.run(run())
    assert redis.deleted == [server.registry_key("hb-test", "e1")] and not redis.stored
    assert any(r.levelno == logging.ERROR and "engine stopped" in r.getMessage() for r in caplog.records)
    # and then the process is told to exit, its registration already withdrawn
    assert exits == [[server.registry_key("hb-test", "e1")]]


class FailingEngine(FakeEngine):
    """Its step thread stops on an error once it has served its first heartbeat."""

    def __init__(self):
        super().__init__()
        self.failure = None

    def stats(self):
        snapshot = super().stats()
        self.failure = "RuntimeError in its step thread (the server log has the cause)"
        return snapshot


def test_an_engine_process_whose_engine_stopped_exits_with_an_error(tmp_path, monkeypatch):
    """A process left up with a dead engine serves nothing and no supervisor restarts it (compose's
    `restart: on-failure` needs an exit with an error status): it withdraws its registration and exits."""
    import pytest
    from live_server import free_port

    from loraplex.platform import engine_factory, redis_clients

    redis = DeletingRedis(failures=0)
    engine = FailingEngine()
    monkeypatch.setattr(server, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(engine_factory, "build_engine", lambda settings: engine)
    monkeypatch.setattr(redis_clients, "async_redis", lambda settings: redis)
    settings = Settings(data_dir=tmp_path, redis_prefix="hb-test", shutdown_timeout=1)
    with pytest.raises(server.EngineStopped, match="the engine stopped: RuntimeError"):
        server.run_engine_server(settings, host="127.0.0.1", port=free_port())
    assert len(redis.deleted) >= 1 and not redis.stored
