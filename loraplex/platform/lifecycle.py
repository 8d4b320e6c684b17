"""Building, starting and stopping the services behind one app."""

from __future__ import annotations

import asyncio
import functools
import logging

from fastapi import FastAPI

from loraplex.config import Settings
from loraplex.engine.client import EngineClient
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.quotas import QuotaLimiter
from loraplex.platform.services import Services

log = logging.getLogger(__name__)

# seconds the shutdown waits for running requests to settle their quota and usage before closing the journal
SETTLE_TIMEOUT = 10.0


def build_services(settings: Settings, *, engine: EngineClient | None = None,
                   limiter: QuotaLimiter | None = None) -> Services:
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_engine(url)
    redis = None
    if settings.redis_url:
        from loraplex.platform.redis_clients import async_redis

        redis = async_redis(settings)
    if limiter is None:
        if redis is not None:
            from loraplex.platform.quotas.redis import RedisQuotaLimiter

            limiter = RedisQuotaLimiter(redis, prefix=settings.redis_prefix)
        else:
            from loraplex.platform.quotas.memory import MemoryQuotaLimiter

            limiter = MemoryQuotaLimiter()
    services = Services(settings=settings, db=db, sessions=make_session_factory(db), limiter=limiter,
                        engine=engine, redis=redis)
    services.owns_engine = engine is None
    if getattr(limiter, "month_seed", False) is None:
        limiter.month_seed = functools.partial(month_tokens, services)
    services.usage = _usage_recorder(services)
    from loraplex.platform.key_use import KeyLastUse

    services.key_use = KeyLastUse(services.sessions)
    from loraplex.platform.tasks.dispatch import TaskDispatcher

    services.tasks = TaskDispatcher(settings)
    return services


async def month_tokens(services: Services, tenant_id: int, month: str) -> int:
    """The tokens a tenant's usage records count in `month` (YYYYMM), as settled quotas count them: failed
    requests count nothing, as in usage reports and billing."""
    from sqlalchemy import func, select

    from loraplex.platform.billing.aggregate import FAILED_STATUSES
    from loraplex.platform.billing.periods import day_start, period_bounds
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import UsageRecord

    first, nxt = period_bounds(f"{month[:4]}-{month[4:]}")
    start, end = day_start(first), day_start(nxt)

    def count() -> int:
        with session_scope(services.sessions) as session:
            return int(session.scalar(
                select(func.coalesce(func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens), 0))
                .where(UsageRecord.tenant_id == tenant_id, UsageRecord.created_at >= start,
                       UsageRecord.created_at < end, UsageRecord.status.not_in(FAILED_STATUSES))))

    return await asyncio.to_thread(count)


def _usage_recorder(services: Services):
    from loraplex.platform.usage import UsageRecorder
    from loraplex.platform.usage.file_journal import FileJournal

    settings = services.settings
    journal_dir = settings.data_dir / "usage-journal"
    spool = None
    if services.redis is not None:
        from loraplex.platform.usage.redis_journal import RedisJournal

        journal = RedisJournal(services.redis, settings.redis_prefix)
        try:  # records Redis does not take wait here (the shared data directory) for the database
            spool = FileJournal(journal_dir, open_now=False)
        except OSError as exc:
            log.warning("no usage spool at %s (%s): records Redis does not take go to the log only",
                        journal_dir, exc)
    else:
        journal = FileJournal(journal_dir)
    from loraplex.platform.usage.inflight import InflightLedger

    ledger = None
    try:
        ledger = InflightLedger(settings.data_dir / "usage-inflight")
    except OSError as exc:
        log.warning("no in-flight usage ledger at %s (%s): a request running when this process is killed "
                    "is not billed", settings.data_dir / "usage-inflight", exc)

    async def settle_interrupted(request) -> None:
        event = request.event
        if not hasattr(services.limiter, "settle_interrupted"):
            return
        await services.limiter.settle_interrupted(event.tenant_id, event.request_id, request.month,
                                                  event.prompt_tokens + event.completion_tokens)

    return UsageRecorder(services.sessions, journal, spool=spool, batch_size=settings.usage_batch_size,
                         interval=settings.usage_flush_interval, ledger=ledger, on_interrupted=settle_interrupted)


def _bind_metrics(services: Services, app: FastAPI) -> None:
    try:
        from loraplex.platform.metrics import get_metrics
    except ImportError:
        return
    metrics = get_metrics(app)
    metrics.bind_engine(lambda: services.engine.stats() if services.engine is not None else None,
                        lambda: getattr(services.engine, "stats_by_engine", lambda: None)())
    services.on_request_finished = metrics.record_request


async def start_services(services: Services, app: FastAPI) -> None:
    settings = services.settings
    if settings.auto_migrate:
        from loraplex.platform.migrate import upgrade_to_head

        await asyncio.to_thread(upgrade_to_head, settings.resolved_database_url)
    if services.engine is None and settings.embedded_engine:
        from loraplex.platform.engine_factory import build_engine

        services.engine = await asyncio.to_thread(build_engine, settings)
    elif services.engine is None and services.redis is not None:
        from loraplex.platform.remote.router import build_router

        services.engine = await asyncio.to_thread(build_router, settings, services.redis)
    if services.engine is not None and services.owns_engine:
        await services.engine.start()
    _bind_metrics(services, app)
    from loraplex.platform.tasks.context import TaskContext, set_context

    # Tasks run in this process (embedded) or the engine queue is consumed here: both use this engine.
    context = TaskContext(settings, services.sessions, services.engine, asyncio.get_running_loop())
    set_context(context)
    if services.owns_engine and hasattr(services.engine, "pinned_adapters"):
        from loraplex.platform.pin_sync import keep_pins_in_sync

        services.background.append(asyncio.create_task(
            keep_pins_in_sync(context, settings.pin_sync_interval), name="pin-sync"))
    if services.tasks.eager and settings.warm_adapters_interval > 0:
        services.background.append(asyncio.create_task(_warm_loop(services), name="warm-adapters"))
    if services.tasks.eager:
        services.background.append(asyncio.create_task(_billing_loop(services), name="billing"))
    from loraplex.platform.recovery import remove_stale_staging, resume_validations

    await asyncio.to_thread(remove_stale_staging, services)
    await services.sweep_retired()  # deletes whose weights a stopped process kept for its requests
    await asyncio.to_thread(resume_validations, services)
    # A journal left by an earlier (crashed) process is replayed before new traffic arrives.
    await services.usage.flush()
    services.background.append(asyncio.create_task(services.usage.run(), name="usage-flusher"))
    services.background.append(asyncio.create_task(services.key_use.run(), name="key-last-use"))
    if hasattr(services.limiter, "run"):  # Redis: keeps this process's in-flight quota entries alive
        services.background.append(asyncio.create_task(services.limiter.run(), name="quota-keep-alive"))
    for hook in services.startup_hooks:
        await hook(services, app)


async def _warm_loop(services: Services) -> None:
    """The embedded default's stand-in for Celery beat: keep pinned adapters pinned and the busiest of the
    last hour warm."""
    while True:
        await asyncio.sleep(services.settings.warm_adapters_interval)
        services.tasks.send("loraplex.warm_popular_adapters")


async def _billing_loop(services: Services) -> None:
    """The embedded default's Celery beat for billing: hourly rollups, statements once a month closes."""
    while True:
        await asyncio.sleep(3600)
        services.tasks.send("loraplex.rollup_usage")
        services.tasks.send("loraplex.finalize_statements")


async def shutdown_services(services: Services) -> None:
    # requests the server ended (or cancelled) settle in shielded code that may still be running: their
    # quota and usage record need Redis and the journal, closed below
    if not await services.requests_settled(SETTLE_TIMEOUT):
        log.warning("%d requests had not settled their usage within SETTLE_TIMEOUT=%g s when the server stopped",
                    len(services.running), SETTLE_TIMEOUT)
    for hook in reversed(services.shutdown_hooks):
        try:
            await hook(services)
        except Exception:
            log.exception("shutdown hook failed")
    for task in services.background:
        task.cancel()
    if services.background:
        await asyncio.gather(*services.background, return_exceptions=True)
    services.background.clear()
    # Task threads may be waiting on this loop (prefetch into the engine): keep it running meanwhile.
    await asyncio.to_thread(services.tasks.shutdown)
    try:
        await services.usage.close()
    except Exception:
        log.exception("final usage flush failed; the journal keeps the records for the next start")
    await services.key_use.close()
    await services.limiter.close()
    if services.engine is not None and services.owns_engine:
        await services.engine.shutdown()
    if services.redis is not None:
        await services.redis.aclose()
    services.db.dispose()
