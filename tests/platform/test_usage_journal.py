"""The local usage journal: a crash loses no finished request's record, replays never duplicate one."""

from __future__ import annotations

import asyncio
import fcntl
import os

import pytest
from sqlalchemy import func, select

from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.models import Tenant, UsageRecord
from loraplex.platform.usage import UsageEvent, UsageRecorder
from loraplex.platform.usage.file_journal import FileJournal

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _event(tenant_id: int, i: int) -> UsageEvent:
    return UsageEvent(request_id=f"req_{i}", tenant_id=tenant_id, api_key_id=1, model="m", adapter_name=None,
                      adapter_version=None, endpoint="completions", prompt_tokens=2, completion_tokens=i,
                      ttft_ms=1, latency_ms=3, status="ok", end_user=None, created_at=UsageEvent.now_iso())


def _sessions(settings):
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    with sessions() as session:
        tenant = Tenant(name="journal")
        session.add(tenant)
        session.commit()
        return sessions, tenant.id


def _count(sessions) -> tuple[int, int]:
    with sessions() as session:
        return session.execute(select(func.count(), func.coalesce(func.sum(UsageRecord.completion_tokens), 0))).one()


def test_crashed_process_journal_is_replayed_once(settings):
    sessions, tenant_id = _sessions(settings)
    journal_dir = settings.data_dir / "usage-journal"
    crashed = FileJournal(journal_dir)
    for i in range(5):
        crashed.append(_event(tenant_id, i))
    with open(crashed._path, "ab") as f:  # a write torn by the crash
        f.write(b'{"request_id": "req_torn", "tena')
    os.close(crashed._fd)  # the process dies: its lock goes with it, nothing was flushed

    recorder = UsageRecorder(sessions, FileJournal(journal_dir))
    assert asyncio.run(recorder.flush()) == 5
    assert _count(sessions) == (5, 0 + 1 + 2 + 3 + 4)
    # the same events journaled again (a replay after a crash mid-flush) change nothing
    again = FileJournal(journal_dir)
    for i in range(5):
        again.append(_event(tenant_id, i))
    again.seal()
    assert asyncio.run(recorder.flush()) == 0
    assert _count(sessions) == (5, 10)
    assert not [p for p in journal_dir.iterdir() if p != recorder.journal._path and p != again._path]


def test_live_journal_of_another_process_is_left_alone(settings):
    sessions, tenant_id = _sessions(settings)
    journal_dir = settings.data_dir / "usage-journal"
    other = FileJournal(journal_dir)  # holds its flock, like a running process
    other.append(_event(tenant_id, 1))
    recorder = UsageRecorder(sessions, FileJournal(journal_dir))
    assert asyncio.run(recorder.flush()) == 0
    assert other._path.exists()
    fcntl.flock(other._fd, fcntl.LOCK_UN)  # that process has exited
    assert asyncio.run(recorder.flush()) == 1


def test_records_are_journaled_before_the_response(data_dir, tiny_llama_dir, make_tenant_factory):
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient
    from platform_helpers import make_settings

    settings = make_settings(data_dir, model=str(tiny_llama_dir), usage_flush_interval=3600)
    app, make = make_tenant_factory(settings, FakeEngine())
    with TestClient(app) as client:
        tenant = make()
        r = client.post("/v1/completions", headers=tenant.headers, json={"model": "fake-base", "prompt": "x",
                                                                        "max_tokens": 2, "user": "end-user-7"})
        request_id = r.headers["x-request-id"]
        journal = app.state.services.usage.journal
        on_disk = journal._path.read_text()  # written before the response, long before any flush
        assert request_id in on_disk and "end-user-7" in on_disk
        with app.state.services.sessions() as session:
            assert session.scalar(select(func.count()).select_from(UsageRecord)) == 0
    with app.state.services.sessions() as session:  # shutdown flushes
        record = session.scalar(select(UsageRecord).where(UsageRecord.request_id == request_id))
    assert record.end_user == "end-user-7" and record.completion_tokens == 2


def test_a_record_the_database_refuses_does_not_block_the_others(settings, caplog):
    from dataclasses import replace

    sessions, tenant_id = _sessions(settings)
    recorder = UsageRecorder(sessions, FileJournal(settings.data_dir / "usage-journal"))
    good = [_event(tenant_id, i) for i in range(3)]
    bad = replace(_event(tenant_id, 9), end_user="\ud800")  # no database stores a lone surrogate

    async def main():
        for event in (good[0], bad, good[1], good[2]):
            await recorder.record(event)
        return await recorder.flush()

    assert asyncio.run(main()) == 3
    assert _count(sessions) == (3, 0 + 1 + 2)
    assert "req_9" in caplog.text


@pytest.mark.integration
def test_a_flush_cancelled_mid_batch_leaves_no_lock_held_and_close_moves_everything(settings):
    """The shutdown cancels the background flush: a batch cut between its take and its ack used to leave the
    Redis journal's lock held for a minute, so the final flush (and every other process's) moved nothing."""
    import uuid

    import redis.asyncio as aioredis

    from loraplex.platform.usage.redis_journal import RedisJournal

    sessions, tenant_id = _sessions(settings)

    async def scenario() -> tuple[int, int, bool]:
        redis = aioredis.from_url(REDIS_URL)
        journal = RedisJournal(redis, f"lpxtest-journal-{uuid.uuid4().hex[:8]}")
        real_ack = journal.ack

        async def slow_ack(receipt):  # a round trip to a remote Redis
            await asyncio.sleep(0.3)
            return await real_ack(receipt)

        journal.ack = slow_ack
        recorder = UsageRecorder(sessions, journal)
        try:
            for i in range(3):
                await recorder.record(_event(tenant_id, i))
            flushing = asyncio.create_task(recorder.flush())
            await asyncio.sleep(0.15)  # the batch is in the database, its ack under way
            flushing.cancel()
            await asyncio.gather(flushing, return_exceptions=True)
            await recorder.close()
            return await journal.pending(), _count(sessions)[0], bool(await redis.exists(journal.lock_key))
        finally:
            await redis.delete(journal.key, journal.lock_key)
            await redis.aclose()

    pending, stored, locked = asyncio.run(scenario())
    assert (pending, stored, locked) == (0, 3, False)


def _redis_journal_scenario(settings, body):
    """Run `body(redis, journal, sessions, tenant_id)` against the real Redis under a key prefix of its own."""
    import uuid

    from loraplex.platform.redis_clients import async_redis
    from loraplex.platform.usage.redis_journal import RedisJournal

    sessions, tenant_id = _sessions(settings)

    async def scenario():
        redis = async_redis(settings, url=REDIS_URL)
        try:
            await redis.ping()
        except Exception:
            await redis.aclose()
            pytest.skip("no Redis on this machine")
        journal = RedisJournal(redis, f"lpxtest-journal-{uuid.uuid4().hex[:8]}")
        try:
            return await body(redis, journal, sessions, tenant_id)
        finally:
            await redis.delete(journal.key, journal.lock_key)
            await redis.aclose()

    return asyncio.run(scenario()), sessions


@pytest.mark.integration
@pytest.mark.parametrize("fails_at", ["insert", "ack"])
def test_a_flush_that_fails_mid_way_loses_and_doubles_nothing(settings, monkeypatch, fails_at):
    """Five records moved two at a time; the second batch fails (its insert, or its trim after the insert when
    Redis drops the connection): the first stays moved, nothing is lost, and the next flush, at once (the lock
    was given back), moves the rest with no record twice."""
    from loraplex.platform.usage import recorder as recorder_module

    calls = []
    real_insert = recorder_module.insert_events

    def insert(sessions, events):
        calls.append(len(events))
        if fails_at == "insert" and len(calls) == 2:
            raise ConnectionError("database went away mid-flush")
        return real_insert(sessions, events)

    monkeypatch.setattr(recorder_module, "insert_events", insert)

    async def body(redis, journal, sessions, tenant_id):
        real_ack, acks = journal.ack, []

        async def ack(receipt):
            acks.append(receipt)
            if fails_at == "ack" and len(acks) == 2:
                import redis.exceptions

                raise redis.exceptions.ConnectionError("Connection closed by server.")
            return await real_ack(receipt)

        journal.ack = ack
        recorder = UsageRecorder(sessions, journal, batch_size=2)
        for i in range(5):
            await recorder.record(_event(tenant_id, i))
        with pytest.raises(Exception, match="went away|closed"):
            await recorder.flush()
        assert not await redis.exists(journal.lock_key)  # given back, not held until it lapses
        await recorder.flush()
        return await journal.pending()

    pending, sessions = _redis_journal_scenario(settings, body)
    assert pending == 0
    assert _count(sessions) == (5, 0 + 1 + 2 + 3 + 4)


@pytest.mark.integration
def test_a_lock_left_by_a_dead_flusher_holds_flushing_only_until_it_lapses(settings):
    async def body(redis, journal, sessions, tenant_id):
        recorder = UsageRecorder(sessions, journal)
        for i in range(3):
            await recorder.record(_event(tenant_id, i))
        await redis.set(journal.lock_key, "a-flusher-that-died", px=300)
        moved_while_held = await recorder.flush()
        while await redis.exists(journal.lock_key):  # its expiry, set by the dead process
            await asyncio.sleep(0.05)
        return moved_while_held, await recorder.flush(), await journal.pending()

    (while_held, after, pending), sessions = _redis_journal_scenario(settings, body)
    assert (while_held, after, pending) == (0, 3, 0)


@pytest.mark.integration
def test_a_lock_taken_again_after_a_lost_reply_is_still_ours(settings):
    """The client sends the lock's SET again when the connection dropped before its reply: the second SET
    finds the key the first one made. That lock is this flusher's, not another's to wait a minute for."""

    async def body(redis, journal, sessions, tenant_id):
        recorder = UsageRecorder(sessions, journal)
        for i in range(2):
            await recorder.record(_event(tenant_id, i))
        real_set = redis.set

        async def set_sent_twice(*args, **kwargs):
            await real_set(*args, **kwargs)  # ran; its reply lost
            return await real_set(*args, **kwargs)  # the resend's reply: NX finds the key

        redis.set = set_sent_twice
        moved = await recorder.flush()
        return moved, await journal.pending(), bool(await redis.exists(journal.lock_key))

    (moved, pending, locked), _ = _redis_journal_scenario(settings, body)
    assert (moved, pending, locked) == (2, 0, False)
