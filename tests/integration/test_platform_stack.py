"""The production shape on the machine's PostgreSQL and Redis, with a real `loraplex worker` subprocess.

Each run gets its own PostgreSQL schema, Redis key prefix and Celery queue names, so concurrent runs on the
same servers never see each other's data or tasks.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

PG_URL = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SECRET = "integration-secret-0123456789"
PROMPT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def _services_available() -> str | None:
    import psycopg2
    import redis

    try:
        psycopg2.connect(PG_URL.replace("postgresql://", "postgres://"), connect_timeout=3).close()
    except Exception as exc:
        return f"PostgreSQL at {PG_URL}: {exc}"
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except Exception as exc:
        return f"Redis at {REDIS_URL}: {exc}"
    return None


@pytest.fixture(scope="module")
def pg_url():
    import psycopg2

    problem = _services_available()
    if problem:
        pytest.fail(f"integration tests need {problem}")
    schema = f"lpx_it_{uuid.uuid4().hex[:10]}"
    conn = psycopg2.connect(PG_URL)
    conn.autocommit = True
    conn.cursor().execute(f"CREATE SCHEMA {schema}")
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    conn.cursor().execute(f"DROP SCHEMA {schema} CASCADE")
    conn.close()


@pytest.fixture(scope="module")
def stack(pg_url, tiny_llama_dir, tmp_path_factory):
    """Settings shared by the API (in this process) and the worker subprocess."""
    from loraplex.config import Settings

    run = uuid.uuid4().hex[:8]
    data_dir = tmp_path_factory.mktemp("stack")
    env = {
        "LORAPLEX_ENVIRONMENT": "test", "LORAPLEX_SECRET_KEY": SECRET, "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_DATABASE_URL": pg_url, "LORAPLEX_REDIS_URL": REDIS_URL, "LORAPLEX_REDIS_PREFIX": f"lpxit-{run}",
        "LORAPLEX_TASK_QUEUE": f"lpxit-{run}-tasks", "LORAPLEX_ENGINE_QUEUE": f"lpxit-{run}-engine",
        "LORAPLEX_MODEL": str(tiny_llama_dir), "LORAPLEX_SERVED_MODEL_NAME": "tiny-base",
        "LORAPLEX_KV_CACHE_MEMORY": str(4 * 1024 * 1024), "LORAPLEX_MAX_MODEL_LEN": "256",
        "LORAPLEX_USAGE_FLUSH_INTERVAL": "0.2",
    }
    settings = Settings(**{k.removeprefix("LORAPLEX_").lower(): v for k, v in env.items()})
    yield settings, env
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"lpxit-{run}*")) + list(client.scan_iter(f"*lpxit-{run}*"))
    if keys:
        client.delete(*keys)


def test_migrations_on_empty_postgres(pg_url):
    from alembic import command

    from loraplex.platform.migrate import alembic_config

    config = alembic_config(pg_url)
    command.upgrade(config, "head")
    command.check(config)


@pytest.fixture(scope="module")
def worker(stack):
    _, env = stack
    from loraplex.platform.bootstrap import prepare_database

    prepare_database(stack[0])
    log = open(stack[0].data_dir / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "worker", "--pool", "solo", "--concurrency", "1",
                             "--no-beat", "--loglevel", "warning"], env={**os.environ, **env},
                            stdout=log, stderr=subprocess.STDOUT)
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def api(stack, worker):
    from live_server import live_server

    from loraplex.platform.app import create_app
    from loraplex.platform.bootstrap import ensure_admin_key
    from loraplex.platform.engine_worker import consume_engine_queue_with_app

    settings, _ = stack
    admin_key = ensure_admin_key(settings)
    app = create_app(settings)
    consume_engine_queue_with_app(app)
    with live_server(app) as url:
        yield url, app, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)


def _tenant(admin: httpx.Client, **quotas) -> str:
    t = admin.post("/admin/api/tenants", json={"name": f"it-{uuid.uuid4().hex[:8]}", **quotas}).json()
    return admin.post(f"/admin/api/tenants/{t['id']}/keys", json={}).json()["key"]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_upload_validated_by_worker_then_prefetched_and_served(api, worker, peft_adapter_zip):
    url, app, admin = api
    key = _tenant(admin)
    r = httpx.post(f"{url}/v1/adapters", params={"wait": "true"}, headers={"Authorization": f"Bearer {key}"},
                   data={"name": "fox"}, files={"file": ("fox.zip", peft_adapter_zip.read_bytes())}, timeout=120)
    assert worker.poll() is None, "the worker died"
    assert r.status_code == 201, r.text
    content_hash = r.json()["content_hash"]
    engine = app.state.services.engine
    deadline = time.monotonic() + 30
    while content_hash not in engine.stats().lora_resident and time.monotonic() < deadline:
        time.sleep(0.1)
    assert content_hash in engine.stats().lora_resident  # the engine queue task warmed it
    out = _client(url, key).chat.completions.create(model="fox", messages=PROMPT, max_tokens=4,
                                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_bad_upload_refused_by_worker(api, worker, tmp_path):
    url, _, admin = api
    key = _tenant(admin)
    r = httpx.post(f"{url}/v1/adapters", params={"wait": "true"}, headers={"Authorization": f"Bearer {key}"},
                   data={"name": "bad"}, files={"file": ("adapter_model.bin", b"\x80\x04K\x01.")}, timeout=120)
    assert r.status_code == 422 and r.json()["error"]["code"] == "pickle_file"
    assert httpx.get(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {key}"}).json()["data"] == []


def test_redis_quota_and_usage_records_in_postgres(api):
    url, app, admin = api
    # quota windows are calendar minutes: keep the whole burst inside one
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)
    key = _tenant(admin, requests_per_minute=3)
    client = _client(url, key)
    ids = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="tiny-base", messages=PROMPT, max_tokens=2,
                                                               extra_body={"ignore_eos": True})
        ids.append(raw.headers["x-request-id"])
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="tiny-base", messages=PROMPT, max_tokens=2)
    assert info.value.response.headers["x-ratelimit-remaining-requests"] == "0"

    from sqlalchemy import select

    from loraplex.platform.models import UsageRecord

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with app.state.services.sessions() as session:
            found = set(session.scalars(select(UsageRecord.request_id).where(UsageRecord.request_id.in_(ids))))
        if found == set(ids):
            break
        time.sleep(0.2)
    assert found == set(ids)
    report = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert report[0]["requests"] == 3 and report[0]["completion_tokens"] == 6


def test_journal_survives_a_crash_and_replays_once(stack, pg_url):
    """Records journaled to Redis but never inserted (the process died) are inserted by the next process,
    exactly once however often the journal is replayed."""
    import redis.asyncio as aioredis
    from sqlalchemy import func, select

    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.models import Tenant, UsageRecord
    from loraplex.platform.usage import UsageEvent, UsageRecorder
    from loraplex.platform.usage.redis_journal import RedisJournal

    settings, _ = stack
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    with sessions() as session:
        tenant = Tenant(name=f"crash-{uuid.uuid4().hex[:6]}")
        session.add(tenant)
        session.commit()
        tenant_id = tenant.id

    def event(i: int) -> UsageEvent:
        return UsageEvent(request_id=f"req_crash_{tenant_id}_{i}", tenant_id=tenant_id, api_key_id=None,
                          model="tiny-base", adapter_name=None, adapter_version=None, endpoint="completions",
                          prompt_tokens=3, completion_tokens=i, ttft_ms=1, latency_ms=2, status="ok", end_user=None,
                          created_at=UsageEvent.now_iso())

    async def main():
        client = aioredis.from_url(REDIS_URL)
        prefix = f"{settings.redis_prefix}-crash"
        dead = UsageRecorder(sessions, RedisJournal(client, prefix))
        for i in range(5):
            await dead.record(event(i))  # journaled, then the process "dies" before flushing
        await client.rpush(f"{prefix}:usage:journal", event(0).to_json())  # a replayed duplicate
        survivor = UsageRecorder(sessions, RedisJournal(client, prefix), batch_size=2)
        inserted = await survivor.flush()
        again = await survivor.flush()
        await client.delete(f"{prefix}:usage:journal")
        await client.aclose()
        return inserted, again

    inserted, again = asyncio.run(main())
    assert (inserted, again) == (5, 0)
    with sessions() as session:
        count, tokens = session.execute(select(func.count(), func.sum(UsageRecord.completion_tokens))
                                        .where(UsageRecord.tenant_id == tenant_id)).one()
    assert (count, tokens) == (5, 0 + 1 + 2 + 3 + 4)


def test_two_api_processes_share_one_quota(stack):
    """Two limiters (as in two API processes) on the same Redis never admit more than the limit together."""
    import redis.asyncio as aioredis

    from loraplex.platform.quotas import QuotaExceeded, QuotaLimits
    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    settings, _ = stack
    limits = QuotaLimits(requests_per_minute=10_000, tokens_per_minute=1_000, max_concurrent=10_000,
                         monthly_token_budget=10**9)

    async def main():
        a, b = aioredis.from_url(REDIS_URL), aioredis.from_url(REDIS_URL)
        prefix = f"{settings.redis_prefix}-shared"
        limiters = [RedisQuotaLimiter(a, prefix), RedisQuotaLimiter(b, prefix)]
        now = time.time()

        async def one(i):
            try:
                await limiters[i % 2].acquire(7, limits, f"r{i}", 37, now=now)
                return 1
            except QuotaExceeded:
                return 0

        admitted = sum(await asyncio.gather(*(one(i) for i in range(100))))
        keys = [k async for k in a.scan_iter(f"{prefix}:*")]
        if keys:
            await a.delete(*keys)
        await a.aclose()
        await b.aclose()
        return admitted

    assert asyncio.run(main()) == 1_000 // 37


def test_uploads_leave_nothing_behind(stack, api):
    # uploads are removed once validated or refused; only the store keeps canonical weights
    settings, _ = stack
    uploads = settings.data_dir / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())
