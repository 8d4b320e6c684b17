"""Liveness (/healthz: the process answers) and readiness (/readyz: it can serve inference now)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from loraplex.platform.deps import ServicesDep
from loraplex.platform.services import Services
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute, tags=["health"])
# a readiness probe answers within its own timeout (often 1 s): a Redis that does not answer in this is down
REDIS_PING_SECONDS = 0.5


@router.get("/healthz")
async def healthz(*, services: ServicesDep) -> dict:
    return {"status": "ok", "model": services.base_model_name, "engine": services.engine_problem() is None}


def _database_ready(services: Services) -> str | None:
    try:
        with services.sessions() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:
        return f"database: {type(exc).__name__}"
    return None


async def _redis_ready(services: Services) -> str | None:
    """Quotas and the usage journal live in Redis: without it no inference request is admitted."""
    if services.redis is None:
        return None
    try:
        await asyncio.wait_for(services.redis.ping(), REDIS_PING_SECONDS)
    except TimeoutError:
        return f"redis: no answer to a ping within {REDIS_PING_SECONDS:g} s (the readiness check's limit)"
    except Exception as exc:
        return f"redis: {type(exc).__name__}"
    return None


@router.get("/readyz")
async def readyz(*, services: ServicesDep) -> JSONResponse:
    """200 when a request could be served now: the database answers, Redis too where it is configured, and an
    engine is there; else 503 with the reasons (for a load balancer's or an orchestrator's readiness check)."""
    problems = []
    engine = services.engine_problem()
    if engine:
        problems.append(f"engine: {engine}")
    database, redis = await asyncio.gather(asyncio.to_thread(_database_ready, services), _redis_ready(services))
    problems += [problem for problem in (database, redis) if problem]
    if problems:
        return JSONResponse({"status": "not ready", "problems": problems}, status_code=503)
    return JSONResponse({"status": "ready", "model": services.base_model_name})
