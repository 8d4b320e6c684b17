"""The limiter contract, run against the in-process limiter and the Redis Lua script alike."""

from __future__ import annotations

import asyncio
import os
import uuid
from contextlib import asynccontextmanager

import pytest

from loraplex.platform.quotas import QuotaExceeded, QuotaLimits
from loraplex.platform.quotas.memory import MemoryQuotaLimiter

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
T0 = 1_800_000_000.0  # a fixed instant, aligned to a minute window
LIMITS = QuotaLimits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=2, monthly_token_budget=250)


async def _redis_or_skip():
    import redis.asyncio as aioredis

    client = aioredis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception:
        await client.aclose()
        pytest.skip("no Redis on this machine")
    return client


@asynccontextmanager
async def _redis_namespace():
    """(client, prefix): the real Redis, with a key prefix of the test's own, whose keys are deleted after."""
    client = await _redis_or_skip()
    prefix = f"lpxtest-{uuid.uuid4().hex[:8]}"
    try:
        yield client, prefix
    finally:
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def limiter(request):
    if request.param == "memory":
        yield MemoryQuotaLimiter()
        return
    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    async with _redis_namespace() as (client, prefix):
        yield RedisQuotaLimiter(client, prefix=prefix)


async def test_requests_per_minute_and_headers(limiter):
    for i in range(3):
        r = await limiter.acquire(1, LIMITS, f"r{i}", 1, now=T0 + i)
        await limiter.settle(r, 1)
        assert r.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, LIMITS, "r3", 1, now=T0 + 10)
    exc = info.value
    assert exc.kind == "requests"
    assert exc.headers["x-ratelimit-limit-requests"] == "3"
    assert exc.headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.headers["x-ratelimit-reset-requests"] == "50s"
    assert exc.headers["retry-after"] == "50"
    # the next window starts fresh; another tenant never shared this one
    await limiter.acquire(1, LIMITS, "r4", 1, now=T0 + 60)
    await limiter.acquire(2, LIMITS, "other", 1, now=T0 + 10)


async def test_tokens_are_reserved_then_settled(limiter):
    big = await limiter.acquire(1, LIMITS, "a", 90, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, LIMITS, "b", 20, now=T0 + 1)
    assert info.value.kind == "tokens"
    await limiter.settle(big, 30)  # used far less than reserved: the rest comes back
    await limiter.settle(big, 30)  # settling twice changes nothing
    r = await limiter.acquire(1, LIMITS, "c", 70, now=T0 + 2)
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_concurrency_slots_free_on_settle(limiter):
    a = await limiter.acquire(1, LIMITS, "a", 1, now=T0)
    await limiter.acquire(1, LIMITS, "b", 1, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, LIMITS, "c", 1, now=T0)
    assert info.value.kind == "concurrent"
    await limiter.settle(a, 1)
    await limiter.acquire(1, LIMITS, "c", 1, now=T0)


async def test_monthly_budget(limiter):
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=10,
                         monthly_token_budget=250)
    for i in range(2):
        r = await limiter.acquire(1, limits, f"m{i}", 100, now=T0 + 60 * i)
        await limiter.settle(r, 100)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "m2", 100, now=T0 + 180)
    assert info.value.kind == "monthly_budget"
    assert int(info.value.headers["retry-after"]) > 0
    # OpenAI's SDKs would retry it within a minute whatever Retry-After says: they are told not to
    assert info.value.headers["x-should-retry"] == "false"


async def test_a_request_larger_than_the_limit_is_not_worth_retrying(limiter):
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, LIMITS, "huge", 101, now=T0)
    assert info.value.kind == "tokens" and "alone exceeds" in str(info.value)
    assert info.value.headers["x-should-retry"] == "false" and "retry-after" not in info.value.headers
    fits = await limiter.acquire(1, LIMITS, "fits", 100, now=T0)
    await limiter.settle(fits, 100)
    with pytest.raises(QuotaExceeded) as info:  # this one fits the next window: worth waiting for
        await limiter.acquire(1, LIMITS, "later", 50, now=T0 + 1)
    assert "x-should-retry" not in info.value.headers and info.value.headers["retry-after"] == "59"


async def test_concurrent_acquires_never_overshoot(limiter):
    limits = QuotaLimits(requests_per_minute=1000, tokens_per_minute=500, max_concurrent=1000,
                         monthly_token_budget=10**9)

    async def one(i):
        try:
            return await limiter.acquire(1, limits, f"x{i}", 30, now=T0)
        except QuotaExceeded:
            return None

    results = await asyncio.gather(*(one(i) for i in range(60)))
    assert sum(r is not None for r in results) == 500 // 30


async def test_a_lost_request_frees_its_slot_after_the_ttl(limiter):
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=1,
                         monthly_token_budget=10**6)
    await limiter.acquire(1, limits, "lost", 1, now=T0)  # its process died: never settled
    with pytest.raises(QuotaExceeded):
        await limiter.acquire(1, limits, "next", 1, now=T0 + 60)
    await limiter.acquire(1, limits, "later", 1, now=T0 + 601)


async def test_a_budget_not_yet_used_up_says_what_is_left(limiter):
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=10,
                         monthly_token_budget=250)
    r = await limiter.acquire(1, limits, "a", 200, now=T0)
    await limiter.settle(r, 200)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "b", 80, now=T0 + 60)
    message = str(info.value)
    assert info.value.kind == "monthly_budget"
    assert "200 used, 50 left" in message and "up to 80" in message and "max_tokens" in message
    c = await limiter.acquire(1, limits, "c", 50, now=T0 + 60)  # what is left is still usable
    await limiter.settle(c, 50)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "d", 1, now=T0 + 120)
    assert "is used up" in str(info.value)


async def test_a_budget_held_only_by_running_requests_is_worth_a_retry(limiter):
    """Running requests reserve up to their max_tokens; a request that fits once they settle gets a
    retryable 429 (not "used up" with x-should-retry: false for the rest of the month)."""
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=10_000, max_concurrent=10,
                         monthly_token_budget=1000)
    used = await limiter.acquire(1, limits, "done", 400, now=T0)
    await limiter.settle(used, 400)
    running = await limiter.acquire(1, limits, "running", 550, now=T0 + 1)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "b", 100, now=T0 + 2)
    assert info.value.kind == "monthly_budget" and "reserved by requests still running" in str(info.value)
    assert "x-should-retry" not in info.value.headers and info.value.headers["retry-after"] == "1"
    await limiter.settle(running, 20)
    await limiter.acquire(1, limits, "b", 100, now=T0 + 3)  # the retry fits
    with pytest.raises(QuotaExceeded) as info:  # more than the budget can ever give: not worth a retry
        await limiter.acquire(1, limits, "c", 600, now=T0 + 4)
    assert info.value.headers["x-should-retry"] == "false"


async def test_a_process_that_dies_mid_request_gives_its_slots_and_reservations_back():
    """An API process killed with requests in flight never settles them. Their in-flight entries lapse (live
    processes keep theirs alive), which frees the tenant's concurrency slots and takes their token
    reservations back off the month, instead of holding them for good."""
    from loraplex.platform.quotas.redis import INFLIGHT_TTL_MS, RedisQuotaLimiter

    async with _redis_namespace() as (client, prefix):
        dead, alive = RedisQuotaLimiter(client, prefix=prefix), RedisQuotaLimiter(client, prefix=prefix)
        limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=10**6, max_concurrent=2,
                             monthly_token_budget=1000)
        await dead.acquire(1, limits, "killed-1", 400, now=T0)
        await dead.acquire(1, limits, "killed-2", 400, now=T0)
        with pytest.raises(QuotaExceeded) as info:  # both slots held
            await alive.acquire(1, limits, "next", 10, now=T0 + 1)
        assert info.value.kind == "concurrent"
        later = T0 + INFLIGHT_TTL_MS / 1000 + 1  # the dead process kept nothing alive
        r = await alive.acquire(1, limits, "next", 900, now=later)  # slots and 800 tokens are back
        assert r.headers  # granted
        await alive.settle(r, 100)
        month = await client.get(f"{prefix}:rl:1:month:{r.month}")
        assert int(month) == 100  # only what was used: the dead process's 800 reserved tokens are gone
        # a live process's long request is kept alive and keeps its slot and reservation
        long = await alive.acquire(1, limits, "long", 300, now=later)
        assert await alive.keep_alive(now=later + INFLIGHT_TTL_MS / 1000 - 1) == 1
        await alive.acquire(1, limits, "probe", 1, now=later + INFLIGHT_TTL_MS / 1000 + 5)
        assert int(await client.get(f"{prefix}:rl:1:month:{r.month}")) == 100 + 300 + 1
        await alive.settle(long, 50)
        assert int(await client.get(f"{prefix}:rl:1:month:{r.month}")) == 100 + 50 + 1


async def test_a_reservation_never_settled_is_not_kept_alive_for_ever(monkeypatch):
    from loraplex.platform.quotas import redis as redis_limiter

    async with _redis_namespace() as (client, prefix):
        limiter = redis_limiter.RedisQuotaLimiter(client, prefix=prefix)
        await limiter.acquire(1, LIMITS, "lost", 10, now=T0)
        assert await limiter.keep_alive(now=T0 + 1) == 1
        monkeypatch.setattr(redis_limiter, "MAX_REQUEST_SECONDS", -1.0)  # as if it were hours old
        assert await limiter.keep_alive(now=T0 + 2) == 0 and not limiter._live


async def test_a_month_without_a_counter_starts_from_the_usage_records(limiter):
    """As after a restart of the embedded server or an emptied Redis: the month's count is seeded once."""
    calls = []

    async def seed(tenant_id, month):
        calls.append((tenant_id, month))
        return {1: 200, 2: 0}[tenant_id]

    limiter.month_seed = seed
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=10,
                         monthly_token_budget=250)
    r = await limiter.acquire(1, limits, "s0", 40, now=T0)
    await limiter.settle(r, 40)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "s1", 20, now=T0 + 1)
    assert info.value.kind == "monthly_budget" and "240 used" in info.value.message
    assert await limiter.month_used(1, now=T0 + 2) == 240
    assert await limiter.month_used(2, now=T0 + 2) == 0
    assert sorted(calls) == [(1, calls[0][1]), (2, calls[0][1])]  # once per tenant and month


async def test_a_counter_lost_while_the_process_runs_is_seeded_again():
    """Redis emptied under a running API process: the next request seeds the month again from the usage
    records instead of counting from 0."""
    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    async with _redis_namespace() as (client, prefix):
        recorded = {"tokens": 0}

        async def seed(tenant_id, month):
            return recorded["tokens"]

        limiter = RedisQuotaLimiter(client, prefix=prefix, month_seed=seed)
        limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=10,
                             monthly_token_budget=250)
        r = await limiter.acquire(1, limits, "a", 200, now=T0)
        await limiter.settle(r, 200)
        recorded["tokens"] = 200  # what the usage records now hold
        await client.delete(*[k async for k in client.scan_iter(f"{prefix}:*month*")])
        with pytest.raises(QuotaExceeded) as info:
            await limiter.acquire(1, limits, "b", 100, now=T0 + 1)
        assert info.value.kind == "monthly_budget" and "200 used" in info.value.message
        await client.delete(*[k async for k in client.scan_iter(f"{prefix}:*month*")])
        assert await limiter.month_used(1, now=T0 + 2) == 200


async def test_used_now_reads_the_current_window_and_month(limiter):
    """What a request without max_tokens is fitted to: the tokens the current minute and month have counted,
    reservations of running requests included; a new minute starts its window from 0."""
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=10,
                         monthly_token_budget=5000)
    assert await limiter.used_now(7, now=T0) == (0, 0)
    r = await limiter.acquire(7, limits, "u0", 40, now=T0)
    await limiter.settle(r, 30)
    await limiter.acquire(7, limits, "u1", 100, now=T0 + 1)  # still running: its reservation counts
    assert await limiter.used_now(7, now=T0 + 2) == (130, 130)
    assert await limiter.used_now(8, now=T0 + 2) == (0, 0)
    assert await limiter.used_now(7, now=T0 + 61) == (0, 130)


async def test_tokens_held_by_running_requests_are_worth_a_short_wait(limiter):
    """A per-minute token limit full of running requests' reservations frees within seconds as they settle:
    Retry-After says so instead of the minute; a request that would not fit even then waits for the window."""
    limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=100, max_concurrent=10,
                         monthly_token_budget=10**6)
    running = await limiter.acquire(1, limits, "running", 90, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "b", 20, now=T0 + 1)
    assert info.value.kind == "tokens" and "90 are reserved by requests still running" in str(info.value)
    assert "use less than they reserved" in str(info.value)
    assert info.value.headers["retry-after"] == "1" and "x-should-retry" not in info.value.headers
    await limiter.settle(running, 60)
    # 60 used, not reserved: only the next window has room for 50
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "c", 50, now=T0 + 2)
    assert info.value.headers["retry-after"] == "58" and "reserved" not in str(info.value)
    await limiter.acquire(1, limits, "d", 40, now=T0 + 2)  # what the settlement gave back is usable at once


async def test_a_request_that_never_ran_gives_its_place_in_the_request_count_back(limiter):
    """The engine refused it before doing any work (a client error): like requests refused before the quota
    check, it does not count against the per-minute request limit."""
    refused = await limiter.acquire(1, LIMITS, "refused", 10, now=T0)
    assert refused.headers["x-ratelimit-remaining-requests"] == "2"
    await limiter.settle(refused, 0, count_request=False)
    await limiter.settle(refused, 0, count_request=False)  # once only
    served = await limiter.acquire(1, LIMITS, "served", 10, now=T0 + 1)
    assert served.headers["x-ratelimit-remaining-requests"] == "2"
    assert served.headers["x-ratelimit-remaining-tokens"] == "90"
    await limiter.settle(served, 10)
    assert (await limiter.acquire(1, LIMITS, "next", 10, now=T0 + 2)).headers[
        "x-ratelimit-remaining-requests"] == "1"


async def test_a_budget_whose_running_requests_may_use_it_all_promises_nothing(limiter):
    """Budget = what is used + 300, eight requests running with 36 tokens reserved each: a ninth that needs
    36 is refused. A retry helps only if the eight use less than they reserved, which is what it says; one
    that would not fit even if they used nothing is told not to retry."""
    limits = QuotaLimits(requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=100,
                         monthly_token_budget=1300)
    done = await limiter.acquire(1, limits, "done", 1000, now=T0)
    await limiter.settle(done, 1000)
    running = [await limiter.acquire(1, limits, f"r{i}", 36, now=T0 + 1) for i in range(8)]
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "ninth", 36, now=T0 + 2)
    message = str(info.value)
    assert "1000 used and 288 reserved by requests still running, 12 free" in message
    assert "only if they use less than they reserved" in message and "Retry when they finish" not in message
    assert "x-should-retry" not in info.value.headers and info.value.headers["retry-after"] == "1"
    for r in running:
        await limiter.settle(r, 36)  # they used all they reserved: the retry fails, now for good
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "ninth", 36, now=T0 + 3)
    assert info.value.headers["x-should-retry"] == "false"
    with pytest.raises(QuotaExceeded) as info:  # more than budget minus used, whatever the running use
        await limiter.acquire(1, limits, "big", 301, now=T0 + 3)
    assert info.value.headers["x-should-retry"] == "false"


async def test_concurrency_slots_of_a_stopped_process_say_when_they_free():
    """An API process that crashed mid-request leaves its in-flight entries until they lapse: Retry-After
    for the concurrency limit is the time until the first lapses, not 1 s; a live request's slot may free any
    moment."""
    from loraplex.platform.quotas.redis import INFLIGHT_TTL_MS, STALE_AFTER_MS, RedisQuotaLimiter

    async with _redis_namespace() as (client, prefix):
        crashed, alive = RedisQuotaLimiter(client, prefix=prefix), RedisQuotaLimiter(client, prefix=prefix)
        limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=10**6, max_concurrent=2,
                             monthly_token_budget=10**6)
        await crashed.acquire(1, limits, "killed-1", 10, now=T0)
        await crashed.acquire(1, limits, "killed-2", 10, now=T0 + 5)
        with pytest.raises(QuotaExceeded) as info:  # just taken: as likely live as not
            await alive.acquire(1, limits, "next", 10, now=T0 + 6)
        assert info.value.headers["retry-after"] == "1"
        later = T0 + 5 + STALE_AFTER_MS / 1000 + 1  # no keep-alive came for either
        with pytest.raises(QuotaExceeded) as info:
            await alive.acquire(1, limits, "next", 10, now=later)
        first_lapses = T0 + INFLIGHT_TTL_MS / 1000
        assert info.value.headers["retry-after"] == str(round(first_lapses - later))
        assert "stopped without finishing them" in str(info.value)
        await alive.acquire(1, limits, "next", 10, now=first_lapses + 0.1)


async def test_a_settlement_redis_did_not_take_is_retried_with_the_keep_alive(monkeypatch):
    """Redis away for a moment as a request finishes: the settlement does not fail the request, and the
    keep-alive loop lands it (freeing the slot and counting what was used) once Redis answers."""
    import redis.exceptions

    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    async with _redis_namespace() as (client, prefix):
        limiter = RedisQuotaLimiter(client, prefix=prefix)
        limits = QuotaLimits(requests_per_minute=100, tokens_per_minute=10**6, max_concurrent=1,
                             monthly_token_budget=10**6)
        r = await limiter.acquire(1, limits, "a", 100, now=T0)
        real_settle = limiter._settle

        async def down(**kwargs):
            raise redis.exceptions.ConnectionError("Connection refused")

        limiter._settle = down
        await limiter.settle(r, 30)  # no exception
        assert limiter._unsettled
        with pytest.raises(redis.exceptions.ConnectionError):
            await limiter.keep_alive(now=T0 + 1)
        limiter._settle = real_settle
        await limiter.keep_alive(now=T0 + 2)
        assert not limiter._unsettled
        assert int(await client.get(f"{prefix}:rl:1:month:{r.month}")) == 30
        await limiter.acquire(1, limits, "b", 1, now=T0 + 3)  # the slot is free


async def test_a_request_that_can_never_fit_is_told_so_before_any_other_limit(limiter):
    """The per-minute request count and the concurrency slots are used up: a request larger than the token
    limit, or than what is left of the month, still gets the 429 that says not to retry, not theirs."""
    limits = QuotaLimits(requests_per_minute=2, tokens_per_minute=200, max_concurrent=2, monthly_token_budget=150)
    done = await limiter.acquire(1, limits, "done", 40, now=T0)
    await limiter.settle(done, 40)
    running = await limiter.acquire(1, limits, "running", 30, now=T0 + 1)  # rpm now used up
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "fits-later", 10, now=T0 + 2)
    assert info.value.kind == "requests" and "x-should-retry" not in info.value.headers
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "huge", 201, now=T0 + 2)
    assert info.value.kind == "tokens" and "alone exceeds" in str(info.value)
    assert info.value.headers["x-should-retry"] == "false"
    # 40 used, 30 reserved by the running request: 111 cannot fit the month even if it used none of them
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "over-month", 111, now=T0 + 2)
    assert info.value.kind == "monthly_budget" and info.value.headers["x-should-retry"] == "false"
    # 100 would fit the month if the running request used nothing: the rpm's retryable 429 stands
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "maybe", 100, now=T0 + 2)
    assert info.value.kind == "requests" and "x-should-retry" not in info.value.headers
    # with the concurrency slots full too, the never-fits answer is the same
    await limiter.settle(running, 30)
    await limiter.acquire(1, limits, "a", 1, now=T0 + 60)
    await limiter.acquire(1, limits, "b", 1, now=T0 + 60)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.acquire(1, limits, "huge2", 201, now=T0 + 61)
    assert info.value.kind == "tokens" and info.value.headers["x-should-retry"] == "false"
