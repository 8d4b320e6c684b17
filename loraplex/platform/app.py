"""create_app(settings): the FastAPI control plane."""

from __future__ import annotations

import importlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex.config import Settings, get_settings
from loraplex.engine.client import EngineClient
from loraplex.platform.body_limit import BodyLimitMiddleware, BodyTimeoutMiddleware
from loraplex.platform.errors import APIError, install_error_handlers
from loraplex.platform.lifecycle import build_services, shutdown_services, start_services
from loraplex.platform.quotas import QuotaLimiter
from loraplex.platform.request_id import RequestIdMiddleware
from loraplex.platform.tenants import TenantError
from loraplex.platform.url_guard import NulInUrlMiddleware

log = logging.getLogger(__name__)

ROUTERS = ("health", "inference", "models", "adapters", "usage", "admin", "admin_adapters")

# Routers other areas add to the app: (module, attribute). Each is included when its module exists.
OPTIONAL_ROUTERS = (
    ("loraplex.platform.metrics", "router"),
    ("loraplex.platform.billing.routes", "router"),
    ("loraplex.platform.billing.admin_routes", "router"),
    ("loraplex.platform.console.routes", "router"),
)


def create_app(settings: Settings | None = None, *, engine: EngineClient | None = None,
               limiter: QuotaLimiter | None = None) -> FastAPI:
    """Build the app. `engine`: an EngineClient to serve with (default: built from settings at startup,
    in this process). `limiter`: override the quota limiter (default: Redis when redis_url is set)."""
    settings = settings or get_settings()
    services = build_services(settings, engine=engine, limiter=limiter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await start_services(services, app)
        try:
            yield
        finally:
            await shutdown_services(services)

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    app.state.services = services
    app.state.settings = settings
    install_error_handlers(app)
    app.add_exception_handler(TenantError, _tenant_error_handler)
    app.add_middleware(BodyTimeoutMiddleware, seconds=settings.request_body_timeout)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(NulInUrlMiddleware)
    app.add_middleware(RequestIdMiddleware)  # outermost: the body limit's refusals carry a request id too

    for name in ROUTERS:
        app.include_router(importlib.import_module(f"loraplex.platform.routes.{name}").router)
    include_optional_routers(app)
    return app


def include_optional_routers(app: FastAPI) -> list[str]:
    """Include the routers of optional areas (console, billing, metrics) that are installed."""
    included = []
    for module_name, attr in OPTIONAL_ROUTERS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        router = getattr(module, attr, None)
        if router is not None:
            app.include_router(router)
            included.append(module_name)
    return included


async def _tenant_error_handler(_request, exc: TenantError):
    code = "conflict" if exc.status == 409 else None
    return APIError(exc.status, str(exc), param=exc.param, code=code).response()
