"""Requests cut off by the end of their server process (SIGKILL, a lost machine) are billed once, from their
last checkpoint in the in-flight ledger, as "interrupted"; a request that finished keeps its own record."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from datetime import date

import pytest
from platform_helpers import migrated_sessions
from sqlalchemy import select

from loraplex.platform.models import Tenant, UsageRecord
from loraplex.platform.quotas import QuotaLimits
from loraplex.platform.quotas.memory import MemoryQuotaLimiter
from loraplex.platform.usage import UsageEvent, UsageRecorder
from loraplex.platform.usage import inflight as inflight_module
from loraplex.platform.usage.file_journal import FileJournal
from loraplex.platform.usage.inflight import InflightLedger, interrupted_requests
from loraplex.platform.usage.report import usage_by_day

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MONTH = "202601"
ADMITTED = "2026-01-15T10:00:00+00:00"


def _opened(request_id: str, tenant_id: int = 1) -> UsageEvent:
    return UsageEvent(request_id=request_id, tenant_id=tenant_id, api_key_id=7, model="base", adapter_name=None,
                      adapter_version=None, endpoint="chat.completions", prompt_tokens=0, completion_tokens=0,
                      ttft_ms=None, latency_ms=0, status="interrupted", end_user="u1", created_at=ADMITTED)


def _die(ledger: InflightLedger) -> None:
    """The process is killed: its flock goes with it, nothing else happens."""
    os.close(ledger._fd)
    ledger._closed = True


def _records(sessions) -> dict[str, tuple[str, int, int]]:
    with sessions() as session:
        rows = session.execute(select(UsageRecord.request_id, UsageRecord.status, UsageRecord.prompt_tokens,
                                      UsageRecord.completion_tokens)).all()
    return {r[0]: tuple(r[1:]) for r in rows}


def _tenant(sessions) -> int:
    with sessions() as session:
        tenant = Tenant(name=f"t{uuid.uuid4().hex[:6]}")
        session.add(tenant)
        session.commit()
        return tenant.id


def test_the_last_checkpoint_of_each_request_left_open_is_what_is_settled():
    lines = [json.dumps(line).encode() for line in [
        {"op": "open", "id": "a", "month": MONTH, "event": vars(_opened("a"))},
        {"op": "cp", "id": "a", "p": 12, "c": 1, "ttft": 40, "lat": 40},
        {"op": "open", "id": "b", "month": MONTH, "event": vars(_opened("b"))},
        {"op": "cp", "id": "a", "p": 12, "c": 65, "ttft": 40, "lat": 1500},
        {"op": "close", "id": "b"},
        {"op": "open", "id": "c", "month": MONTH, "event": vars(_opened("c"))},
        # a compaction that died half-way wrote a's lines again
        {"op": "open", "id": "a", "month": MONTH, "event": vars(_opened("a"))},
        {"op": "cp", "id": "a", "p": 12, "c": 65, "ttft": 40, "lat": 1500},
    ]] + [b'{"op": "cp", "id": "c", "p": 3']  # torn by the kill

    settled = {r.event.request_id: r for r in interrupted_requests(lines)}

    assert set(settled) == {"a", "c"}  # b finished
    a = settled["a"].event
    assert (a.status, a.prompt_tokens, a.completion_tokens, a.ttft_ms, a.latency_ms) == ("interrupted", 12, 65,
                                                                                          40, 1500)
    assert a.created_at == "2026-01-15T10:00:01.500000+00:00"  # when its last counted token was
    assert (a.tenant_id, a.api_key_id, a.endpoint, a.end_user) == (1, 7, "chat.completions", "u1")
    assert settled["a"].month == MONTH
    c = settled["c"].event  # admitted, killed before its first token: a request, with nothing to bill
    assert (c.prompt_tokens, c.completion_tokens, c.ttft_ms) == (0, 0, None)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_recovery_records_orphans_once_and_a_finished_request_keeps_its_record(tmp_path, kind):
    with migrated_sessions(kind, tmp_path, "lpx_cut") as sessions:
        tenant_id = _tenant(sessions)
        journal_dir, ledger_dir = tmp_path / "journal", tmp_path / "inflight"
        dead_journal, dead = FileJournal(journal_dir), InflightLedger(ledger_dir)
        for request_id in ("cut", "queued", "finished", "refused"):
            dead.open(_opened(request_id, tenant_id), MONTH)
        dead.checkpoint("cut", 12, 1, 40, 40)
        dead.checkpoint("cut", 12, 64, 40, 900)
        dead.checkpoint("finished", 5, 3, 10, 20)
        dead.close("refused")
        # "finished" was journaled whole, then the process was killed before its ledger line said so
        dead_journal.append(UsageEvent(**{**vars(_opened("finished", tenant_id)), "status": "ok",
                                          "prompt_tokens": 5, "completion_tokens": 9}))
        os.close(dead_journal._fd)
        _die(dead)
        left = next(ledger_dir.glob("inflight-*.jsonl"))
        saved = tmp_path / "saved.jsonl"
        shutil.copy(left, saved)

        counted = []

        async def on_interrupted(request):
            counted.append((request.event.request_id, request.month,
                            request.event.prompt_tokens + request.event.completion_tokens))

        recorder = UsageRecorder(sessions, FileJournal(journal_dir), ledger=InflightLedger(ledger_dir),
                                 on_interrupted=on_interrupted)
        assert asyncio.run(recorder.flush()) == 3  # the finished one from the journal, two from the ledger
        assert _records(sessions) == {"cut": ("interrupted", 12, 64), "queued": ("interrupted", 0, 0),
                                      "finished": ("ok", 5, 9)}
        assert sorted(counted) == [("cut", MONTH, 76), ("queued", MONTH, 0)]
        assert not left.exists()
        with sessions() as session:  # reports tell them apart, and bill their tokens
            [bucket] = usage_by_day(session, tenant_id, date(2026, 1, 15), date(2026, 1, 15))
        assert (bucket.requests, bucket.interrupted_requests, bucket.failed_requests) == (3, 2, 0)
        assert bucket.total_tokens == 76 + 14

        # a recovery that is run again (killed itself before it removed the ledger) counts nothing twice
        shutil.copy(saved, left)
        assert asyncio.run(recorder.flush()) == 0
        assert len(counted) == 2 and not left.exists()
        assert _records(sessions)["cut"] == ("interrupted", 12, 64)
        asyncio.run(recorder.close())


def test_a_live_processs_ledger_is_left_alone(tmp_path, settings):
    from loraplex.platform.db import make_engine, make_session_factory

    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    tenant_id = _tenant(sessions)
    other = InflightLedger(tmp_path)  # holds its flock: its process is running this request now
    other.open(_opened("running", tenant_id), MONTH)
    other.checkpoint("running", 4, 2, 5, 5)
    recorder = UsageRecorder(sessions, FileJournal(tmp_path / "journal"), ledger=InflightLedger(tmp_path))
    assert asyncio.run(recorder.flush()) == 0
    assert _records(sessions) == {}
    _die(other)
    assert asyncio.run(recorder.flush()) == 1
    assert _records(sessions) == {"running": ("interrupted", 4, 2)}


def test_a_compacted_ledger_keeps_only_the_open_requests(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight_module, "COMPACT_BYTES", 2000)
    ledger = InflightLedger(tmp_path)
    ledger.open(_opened("long"), MONTH)
    ledger.checkpoint("long", 3, 64, 1, 100)
    first = ledger._path
    for i in range(20):
        ledger.open(_opened(f"short{i}"), MONTH)
        ledger.checkpoint(f"short{i}", 3, 1, 1, 1)
        ledger.close(f"short{i}")
    assert not first.exists()  # rewritten, at least once
    assert ledger._path.stat().st_size < 2000
    assert ledger.open_requests == 1
    lines = ledger._path.read_bytes().splitlines()
    assert [(r.event.request_id, r.event.completion_tokens) for r in interrupted_requests(lines)] == [("long", 64)]
    ledger.close("long")
    ledger.close_file()
    assert list(tmp_path.iterdir()) == []  # nothing open at a clean shutdown: nothing left behind


async def test_memory_limiter_counts_an_interrupted_request_once_in_a_month_it_has_counted():
    seeded = {(1, MONTH): 100}

    async def seed(tenant_id, month):
        return seeded.get((tenant_id, month), 0)

    limiter = MemoryQuotaLimiter(month_seed=seed)
    # a month not counted yet starts from the usage records, which hold the interrupted one already
    await limiter.settle_interrupted(2, "r0", MONTH, 50)
    seeded[(2, MONTH)] = 50
    # 2026-01-15, in MONTH
    assert await limiter.month_used(2, now=1_768_471_200.0) == 50
    assert await limiter.month_used(1, now=1_768_471_200.0) == 100
    await limiter.settle_interrupted(1, "r1", MONTH, 30)
    assert await limiter.month_used(1, now=1_768_471_200.0) == 130


@pytest.mark.integration
async def test_redis_limiter_settles_a_dead_processs_reservation_or_counts_a_lapsed_one():
    import redis.asyncio as aioredis

    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    client = aioredis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception:
        await client.aclose()
        pytest.skip("no Redis on this machine")
    prefix = f"lpxtest-{uuid.uuid4().hex[:8]}"
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=10**6, max_concurrent=1,
                         monthly_token_budget=10**6)
    now = 1_768_471_200.0  # in MONTH
    try:
        dead, restarted = RedisQuotaLimiter(client, prefix=prefix), RedisQuotaLimiter(client, prefix=prefix)
        await dead.acquire(1, limits, "cut", 500, now=now)  # its process is killed mid-request
        assert await restarted.month_used(1, now=now) == 500
        await restarted.settle_interrupted(1, "cut", MONTH, 120)
        assert await restarted.month_used(1, now=now) == 120  # the reservation replaced by what it used
        # its concurrency slot is free at once, not when its entry lapses
        second = await restarted.acquire(1, limits, "next", 10, now=now + 1)
        await restarted.settle(second, 10)
        assert await restarted.month_used(1, now=now) == 130
        # a reservation that lapsed already (taken back off the month): the tokens are added
        await restarted.settle_interrupted(1, "lapsed", MONTH, 40)
        assert await restarted.month_used(1, now=now) == 170
    finally:
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


# an API process as `loraplex serve` runs it, with the fake engine producing a token every 20 ms
_SERVER = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import uvicorn
from fake_engine import FakeEngine
from platform_helpers import make_settings
from loraplex.platform.app import create_app

settings = make_settings(Path({data!r}), usage_flush_interval=3600)
uvicorn.run(create_app(settings, engine=FakeEngine(token_delay=0.02)), host="127.0.0.1", port={port},
            log_level="warning")
"""


@pytest.mark.slow
def test_a_stream_cut_by_sigkill_is_billed_once_from_its_last_checkpoint(data_dir, make_tenant_factory):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient
    from live_server import free_port
    from platform_helpers import make_settings

    settings = make_settings(data_dir, usage_flush_interval=3600)
    app, make = make_tenant_factory(settings, FakeEngine())
    with TestClient(app):
        tenant = make()
    port = free_port()
    script = _SERVER.format(tests=str(Path(__file__).parent), data=str(data_dir), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    received, request_id = 0, None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        body = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", headers=tenant.headers,
                          json=body, timeout=30) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    received += 1
                if received == 100:
                    proc.send_signal(signal.SIGKILL)  # mid-stream: no shutdown, no settlement, no record
                    break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    prompt_tokens = len(FakeEngine().encode_chat(body["messages"]))
    for _ in range(2):  # started twice: the second start finds nothing left to settle
        app, _make = make_tenant_factory(settings, FakeEngine())
        with TestClient(app):  # the start settles the dead process's requests before it serves
            services = app.state.services
            with services.sessions() as session:
                records = session.scalars(select(UsageRecord)).all()
            month_used = asyncio.run(services.limiter.month_used(tenant.tenant_id))
        assert [r.request_id for r in records] == [request_id]
        record = records[0]
        assert record.status == "interrupted"
        assert record.prompt_tokens == prompt_tokens
        # checkpointed at token 64 at the latest (CHECKPOINT_TOKENS) before the 65th was sent, and never
        # more than were generated before the kill (the stream was at most a few tokens ahead of the reader)
        assert 64 <= record.completion_tokens <= 200
        assert received - 64 <= record.completion_tokens
        assert month_used == record.prompt_tokens + record.completion_tokens
    assert list((data_dir / "usage-inflight").iterdir()) == []


def test_a_request_is_checkpointed_every_so_many_tokens_not_every_token(data_dir, make_tenant_factory,
                                                                        monkeypatch):
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient
    from platform_helpers import make_settings

    from loraplex.platform.inference import job as job_module

    monkeypatch.setattr(job_module, "CHECKPOINT_SECONDS", 3600.0)  # by tokens only, however slow the machine
    app, make = make_tenant_factory(make_settings(data_dir), FakeEngine())
    with TestClient(app) as client:
        tenant = make()
        r = client.post("/v1/chat/completions", headers=tenant.headers,
                        json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 200, "stream": True})
        assert r.status_code == 200
        ledger = app.state.services.usage.ledger
        lines = [json.loads(line) for line in ledger._path.read_bytes().splitlines()]
        assert ledger.open_requests == 0
    request_id = r.headers["x-request-id"]
    assert [line["op"] for line in lines] == ["open", "cp", "cp", "cp", "cp", "close"]
    assert {line["id"] for line in lines} == {request_id}
    assert [line["c"] for line in lines if line["op"] == "cp"] == [1, 65, 129, 193]
    assert not list((data_dir / "usage-inflight").iterdir())  # a clean shutdown leaves no ledger behind
