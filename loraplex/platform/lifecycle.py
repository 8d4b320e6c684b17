"""Building, starting and stopping the services behind one app."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from loraplex.config import Settings
from loraplex.engine.client import EngineClient
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.quotas import QuotaLimiter
from loraplex.platform.services import Services

log = logging.getLogger(__name__)


def build_services(settings: Settings, *, engine: EngineClient | None = None,
                   limiter: QuotaLimiter | None = None) -> Services:
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_engine(url)
    redis = None
    if settings.redis_url:
        import redis.asyncio as aioredis

        redis = aioredis.from_url(settings.redis_url)
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
    return services


async def start_services(services: Services, app: FastAPI) -> None:
    settings = services.settings
    if settings.auto_migrate:
        from loraplex.platform.migrate import upgrade_to_head

        await asyncio.to_thread(upgrade_to_head, settings.resolved_database_url)
    if services.engine is None and settings.embedded_engine:
        from loraplex.platform.engine_factory import build_engine

        services.engine = await asyncio.to_thread(build_engine, settings)
    if services.engine is not None and services.owns_engine:
        await services.engine.start()
    for hook in services.startup_hooks:
        await hook(services, app)


async def shutdown_services(services: Services) -> None:
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
    await services.limiter.close()
    if services.engine is not None and services.owns_engine:
        await services.engine.shutdown()
    if services.redis is not None:
        await services.redis.aclose()
    services.db.dispose()
