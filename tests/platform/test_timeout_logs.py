"""A log line (or error) that reports a timeout says which one ran out: its setting or constant, and its value."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest


def test_a_quota_settlement_redis_does_not_answer_in_time_names_settle_seconds(monkeypatch, caplog):
    from loraplex.platform.quotas import Reservation
    from loraplex.platform.quotas import redis as quota_redis

    class SlowRedis:
        def register_script(self, text):
            async def script(**kwargs):
                await asyncio.sleep(10)

            return script

    monkeypatch.setattr(quota_redis, "SETTLE_SECONDS", 0.01)
    limiter = quota_redis.RedisQuotaLimiter(SlowRedis(), prefix="t")
    with caplog.at_level(logging.WARNING, logger=quota_redis.log.name):
        asyncio.run(limiter.settle(Reservation(1, "req_1", 10, 0, "203001"), 5))
    assert "SETTLE_SECONDS=0.01 s" in caplog.text and limiter._unsettled


def test_a_usage_record_redis_does_not_take_in_time_names_append_seconds(tmp_path, caplog):
    from loraplex.platform.usage.event import UsageEvent
    from loraplex.platform.usage.file_journal import FileJournal
    from loraplex.platform.usage.recorder import UsageRecorder
    from loraplex.platform.usage.redis_journal import RedisJournal

    class SlowJournal(RedisJournal):
        def __init__(self):
            pass

        async def append(self, event):
            await asyncio.sleep(10)

    recorder = UsageRecorder(None, SlowJournal(), spool=FileJournal(tmp_path, open_now=False), append_seconds=0.05)
    event = UsageEvent(request_id="req_1", tenant_id=1, api_key_id=None, model="m", adapter_name=None,
                       adapter_version=None, endpoint="completions", prompt_tokens=1, completion_tokens=1,
                       ttft_ms=None, latency_ms=1, status="ok", end_user=None, created_at=UsageEvent.now_iso())
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.usage.recorder"):
        asyncio.run(recorder.record(event))
    assert "APPEND_SECONDS=0.05 s" in caplog.text


@pytest.mark.parametrize("error,named", [
    (httpx.ReadTimeout(""), "STREAM_READ_TIMEOUT=60 s"),
    (httpx.ConnectTimeout(""), "connect timeout, HTTP_TIMEOUT=10 s"),
])
def test_an_engine_timeout_names_the_timeout(error, named):
    from loraplex.platform.remote.client import _why

    assert named in _why(error)


def test_a_redis_connect_timeout_names_its_setting():
    from redis.exceptions import TimeoutError as RedisTimeout

    from loraplex.config import Settings
    from loraplex.platform.outage import error_text
    from loraplex.platform.redis_clients import sync_redis

    sync_redis(Settings(environment="test", redis_url="redis://127.0.0.1:1/0", redis_connect_timeout=2.5))
    assert "LORAPLEX_REDIS_CONNECT_TIMEOUT=2.5 s" in error_text(RedisTimeout("Timeout connecting to server"))
    assert error_text(ValueError("x")) == "x"


def test_an_engine_call_of_a_task_that_times_out_names_engine_call_timeout(monkeypatch):
    import threading

    from loraplex.platform.tasks import context as context_module
    from loraplex.platform.tasks.context import TaskContext

    monkeypatch.setattr(context_module, "ENGINE_CALL_TIMEOUT", 0.05)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ctx = TaskContext(None, None, object(), loop)

        async def never(engine):
            await asyncio.Event().wait()

        with pytest.raises(TimeoutError, match="ENGINE_CALL_TIMEOUT=0.05 s"):
            ctx.call_engine(never)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
