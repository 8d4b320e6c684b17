"""The monthly budget survives a restart: a limiter's first count of a month starts from the usage records."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from loraplex.platform.db import session_scope
from loraplex.platform.models import UsageRecord
from loraplex.platform.quotas import QuotaExceeded, QuotaLimits
from loraplex.platform.quotas.memory import MemoryQuotaLimiter


def _chat(client, tenant, **body):
    payload = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    payload.update(body)
    return client.post("/v1/chat/completions", headers=tenant.headers, json=payload)


def test_usage_of_an_earlier_run_counts_against_the_monthly_budget(app, client, make_tenant):
    tenant = make_tenant(monthly_token_budget=500)
    # what an earlier run of the server recorded this month (its counter died with it)
    with session_scope(app.state.services.sessions) as s:
        s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                          model="fake-base", adapter_name=None, adapter_version=None, endpoint="chat",
                          prompt_tokens=400, completion_tokens=95, ttft_ms=1, latency_ms=10, status="ok",
                          created_at=datetime.now(UTC)))
        # a request that failed on the server's side: neither billed nor counted against the budget
        s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                          model="fake-base", adapter_name=None, adapter_version=None, endpoint="chat",
                          prompt_tokens=300, completion_tokens=30, ttft_ms=1, latency_ms=10, status="error",
                          created_at=datetime.now(UTC)))
    r = _chat(client, tenant)
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text
    assert "495 used" in r.json()["error"]["message"]
    other = make_tenant(monthly_token_budget=500)  # the other tenant's month is its own
    assert _chat(client, other).status_code == 200


async def test_the_seed_is_read_once_per_tenant_and_month():
    calls = []

    async def seed(tenant_id, month):
        calls.append((tenant_id, month))
        return 90

    limiter = MemoryQuotaLimiter(month_seed=seed)
    limits = QuotaLimits(100, 10_000, 10, 100)
    reservation = await limiter.acquire(1, limits, "a", 10, now=1_800_000_000)
    await limiter.settle(reservation, 10)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "b", 1, now=1_800_000_001)
    assert info.value.kind == "monthly_budget"
    assert await limiter.month_used(1, now=1_800_000_002) == 100
    assert calls == [(1, "202701")]


async def test_a_seed_that_fails_counts_from_zero_and_is_tried_again():
    attempts = []

    async def seed(tenant_id, month):
        attempts.append(month)
        if len(attempts) == 1:
            raise ConnectionError("database down")
        return 50

    limiter = MemoryQuotaLimiter(month_seed=seed)
    limits = QuotaLimits(100, 10_000, 10, 100)
    await limiter.acquire(1, limits, "a", 10, now=1_800_000_000)
    assert await limiter.month_used(1, now=1_800_000_001) == 60
    assert len(attempts) == 2


def test_a_request_that_fails_in_the_engine_gives_its_tokens_back(app, client, make_tenant, fake_engine):
    """Its tokens are not in the tenant's usage nor bill, so the budget and the minute's tokens do not keep
    them either."""
    import asyncio

    tenant = make_tenant(monthly_token_budget=10_000)
    assert _chat(client, tenant).status_code == 200
    limiter = app.state.services.limiter
    before = asyncio.run(limiter.used_now(tenant.tenant_id))
    fake_engine.fail_at_step = 3  # three tokens out, then the device is lost
    try:
        r = _chat(client, tenant, max_tokens=20)
    finally:
        fake_engine.fail_at_step = None
    assert r.status_code == 500, r.text
    assert asyncio.run(limiter.used_now(tenant.tenant_id)) == before
