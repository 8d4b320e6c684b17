"""A Redis that does not take a finished request's usage record: the request still gets its answer (its usage
chunk in a stream), the record waits in the local spool, and reaches the usage records exactly once."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from platform_helpers import make_settings
from sqlalchemy import func, select

from loraplex.platform.models import UsageRecord
from loraplex.platform.usage import UsageEvent, UsageRecorder
from loraplex.platform.usage.file_journal import FileJournal
from loraplex.platform.usage.redis_journal import RedisJournal


class FlakyRedis:
    """The few commands the Redis journal uses, in memory. `down`: every command fails as a Redis that is
    not there does; `lose_answers`: an RPUSH lands but its answer never comes back (a connection cut after
    the write), so the record is in Redis and, once the client gives up, in the spool too."""

    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}
        self.values: dict[str, bytes] = {}
        self.down = False
        self.lose_answers = False
        self.failed_pushes = 0

    def _check(self) -> None:
        import redis.exceptions

        if self.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    async def rpush(self, key: str, value: str) -> int:
        if self.lose_answers:
            self.lists.setdefault(key, []).append(value.encode())
        if self.down or self.lose_answers:
            self.failed_pushes += 1
            import redis.exceptions

            raise redis.exceptions.ConnectionError("Connection reset by peer")
        self.lists.setdefault(key, []).append(value.encode())
        return len(self.lists[key])

    async def set(self, key: str, value: str, nx: bool = False, px: int | None = None) -> bool:
        self._check()
        if nx and key in self.values:
            return False
        self.values[key] = value.encode()
        return True

    async def get(self, key: str):
        self._check()
        return self.values.get(key)

    async def delete(self, *keys: str) -> int:
        self._check()
        return sum(self.values.pop(k, None) is not None or self.lists.pop(k, None) is not None for k in keys)

    async def lrange(self, key: str, start: int, end: int) -> list[bytes]:
        self._check()
        return list(self.lists.get(key, [])[start:end + 1])

    async def llen(self, key: str) -> int:
        self._check()
        return len(self.lists.get(key, []))

    def register_script(self, _source: str):
        async def trim_if_owner(keys, args):  # the journal's one script
            self._check()
            if self.values.get(keys[1]) != str(args[0]).encode():
                return 0
            self.lists[keys[0]] = self.lists.get(keys[0], [])[int(args[1]):]
            self.values.pop(keys[1], None)
            return 1

        return trim_if_owner


def _rows(services) -> list[UsageRecord]:
    with services.sessions() as session:
        return list(session.scalars(select(UsageRecord).order_by(UsageRecord.id)))


@pytest.fixture
def spooling_app(data_dir, tiny_llama_dir, make_tenant_factory):
    """An app whose usage journal is a FlakyRedis, with the production spool in the data directory; the
    background flush is left to the test."""
    settings = make_settings(data_dir, model=str(tiny_llama_dir), usage_flush_interval=3600)
    app, make_tenant = make_tenant_factory(settings, FakeEngine(token_delay=0.01))
    services = app.state.services
    redis = FlakyRedis()
    services.usage = UsageRecorder(services.sessions, RedisJournal(redis, "lpxtest"),
                                   spool=FileJournal(data_dir / "usage-journal", open_now=False),
                                   interval=3600, append_seconds=0.3)
    return app, make_tenant, redis


@pytest.mark.parametrize("lose_answers", [False, True], ids=["redis-down", "answer-lost"])
def test_requests_running_when_redis_goes_away_are_answered_and_recorded_once(spooling_app, lose_answers):
    app, make_tenant, redis = spooling_app
    services = app.state.services
    body = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    with TestClient(app) as client:
        tenant = make_tenant()
        redis.down, redis.lose_answers = not lose_answers, lose_answers
        plain = client.post("/v1/chat/completions", headers=tenant.headers, json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 12
        with client.stream("POST", "/v1/chat/completions", headers=tenant.headers,
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
            streamed_id = r.headers["x-request-id"]
        assert events[-1] == "[DONE]"
        usage_chunk = json.loads(events[-2])
        assert "error" not in usage_chunk and usage_chunk["usage"]["completion_tokens"] == 12
        assert redis.failed_pushes >= 2
        spool = services.usage.spool
        assert not _rows(services)  # nothing flushed yet: both records wait in the spool
        assert len([p for p in spool.dir.iterdir() if p.stat().st_size]) == 1

        # Redis is back: the flush moves the spool (and, where a push did land, Redis's copy) exactly once
        redis.down = redis.lose_answers = False
        client.portal.call(services.usage.flush)
        client.portal.call(services.usage.flush)
        rows = _rows(services)
        assert sorted(r.request_id for r in rows) == sorted([plain.headers["x-request-id"], streamed_id])
        assert all(r.status == "ok" and r.completion_tokens == 12 for r in rows)
        assert not redis.lists.get("lpxtest:usage:journal")
        assert not [p for p in spool.dir.iterdir() if p.stat().st_size]
        usage = client.get("/v1/usage", headers=tenant.headers).json()
        assert sum(d["requests"] for d in usage["data"]) == 2, usage


def test_the_spool_reaches_the_database_while_redis_is_still_down(settings):
    """The spool needs only the database: a flush moves it even while Redis does not answer (the flush as a
    whole still reports Redis's failure, for the outage log)."""
    import redis.exceptions

    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.models import Tenant

    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    with sessions() as session:
        session.add(tenant := Tenant(name="spooled"))
        session.commit()
        tenant_id = tenant.id
    fake = FlakyRedis()
    recorder = UsageRecorder(sessions, RedisJournal(fake, "lpxtest"),
                             spool=FileJournal(settings.data_dir / "usage-journal", open_now=False),
                             append_seconds=0.2)
    event = UsageEvent(request_id="req_spooled", tenant_id=tenant_id, api_key_id=None, model="m",
                       adapter_name=None, adapter_version=None, endpoint="completions", prompt_tokens=3,
                       completion_tokens=4, ttft_ms=1, latency_ms=2, status="ok", end_user=None,
                       created_at=UsageEvent.now_iso())

    async def scenario():
        fake.down = True
        await recorder.record(event)  # retried for 0.2 s, then spooled: no exception for the request
        with pytest.raises(redis.exceptions.ConnectionError):
            await recorder.flush()
        await recorder.record(event)  # the same record again (a retried settlement): still one row
        fake.down = False
        assert await recorder.flush() == 0
        await recorder.close()

    asyncio.run(scenario())
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(UsageRecord)) == 1
        assert session.scalar(select(UsageRecord.completion_tokens)) == 4


def test_a_record_neither_redis_nor_the_spool_takes_is_logged_whole(settings, caplog):
    from loraplex.platform.db import make_engine, make_session_factory

    redis = FlakyRedis()
    redis.down = True
    recorder = UsageRecorder(make_session_factory(make_engine(settings.resolved_database_url)),
                             RedisJournal(redis, "lpxtest"), spool=None, append_seconds=0.05)
    event = UsageEvent(request_id="req_nowhere", tenant_id=1, api_key_id=None, model="m", adapter_name=None,
                       adapter_version=None, endpoint="completions", prompt_tokens=1, completion_tokens=2,
                       ttft_ms=None, latency_ms=1, status="ok", end_user=None, created_at=UsageEvent.now_iso())
    asyncio.run(recorder.record(event))
    assert event.to_json() in caplog.text
