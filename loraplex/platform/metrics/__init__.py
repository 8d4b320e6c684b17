"""Prometheus metrics for the control plane and its engine, plus the rolling window behind the dashboard.

The request path calls `record_request(app, ...)` (or the bound `services.on_request_finished`) once per
finished request; engine gauges and counters are read from `EngineStats` at scrape time. Per-adapter and
per-tenant labels are bounded: only the top-N names by requests in the last window get their own series,
the rest share the label "other".
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response

from loraplex.engine.client import EngineStats
from loraplex.platform.errors import unauthorized
from loraplex.platform.metrics.engine import EngineCollector, engine_summary
from loraplex.platform.metrics.labels import OTHER, TopN
from loraplex.platform.metrics.registry import BASE_MODEL_LABEL, STATUSES, PlatformMetrics
from loraplex.platform.metrics.window import FinishedRequest, RecentWindow, percentile
from loraplex.platform.strict_json import StrictJsonRoute

__all__ = [
    "BASE_MODEL_LABEL", "OTHER", "STATUSES", "EngineCollector", "FinishedRequest", "PlatformMetrics",
    "RecentWindow", "TopN", "engine_summary", "get_metrics", "percentile", "record_request", "router",
]


def get_metrics(app) -> PlatformMetrics:
    """The app's metrics, created on first use so any code path can record without setup order worries."""
    metrics = getattr(app.state, "metrics", None)
    if metrics is None:
        metrics = PlatformMetrics()
        metrics.bind_engine(lambda: _engine_stats_of(app))
        app.state.metrics = metrics
    return metrics


def record_request(app, **fields) -> None:
    """Call once per finished inference request (see PlatformMetrics.record_request for the fields)."""
    get_metrics(app).record_request(**fields)


def _engine_stats_of(app) -> EngineStats | None:
    services = getattr(app.state, "services", None)
    engine = getattr(services, "engine", None)
    return engine.stats() if engine is not None else None


router = APIRouter(route_class=StrictJsonRoute, include_in_schema=False)


def _check_scrape_token(request: Request) -> None:
    services = getattr(request.app.state, "services", None)
    token = getattr(getattr(services, "settings", None), "metrics_token", None)
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise unauthorized("/metrics needs 'Authorization: Bearer <LORAPLEX_METRICS_TOKEN>'")


@router.get("/metrics")
def metrics_endpoint(request: Request) -> Response:
    """Prometheus text format. It names tenants and adapters: set LORAPLEX_METRICS_TOKEN, or keep it behind
    the network boundary."""
    _check_scrape_token(request)
    metrics = get_metrics(request.app)
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
