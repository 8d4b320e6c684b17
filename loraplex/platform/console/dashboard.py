"""The live dashboard: request rates and latency percentiles from the metrics window, engine gauges
from EngineStats, and which adapters (by tenant and name) sit in the engine's caches."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy import select

from loraplex.platform.console.deps import ConsoleDep
from loraplex.platform.console.templating import SECURITY_HEADERS, render
from loraplex.platform.deps import ServicesDep
from loraplex.platform.metrics import engine_summary, get_metrics
from loraplex.platform.models import Adapter, AdapterVersion, Tenant, VersionStatus
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)


@router.get("/dashboard", response_class=HTMLResponse)
def dashboard_page(request: Request, context: ConsoleDep) -> HTMLResponse:
    return render(request, "dashboard.html", context)


def _adapter_names(services, hashes: set[str]) -> dict[str, list[tuple[str, str]]]:
    """content hash -> every (adapter, tenant) whose ready version it is: tenants who uploaded the same
    weights share one cached copy, and each of them is listed."""
    if not hashes:
        return {}
    with services.sessions() as session:
        rows = session.execute(
            select(AdapterVersion.content_hash, Adapter.name, Tenant.name)
            .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
            .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
            .where(AdapterVersion.content_hash.in_(sorted(hashes)),
                   AdapterVersion.status == VersionStatus.ready.value)
        ).all()
    out: dict[str, list[tuple[str, str]]] = {}
    for h, name, tenant in rows:
        if (name, tenant) not in out.setdefault(h, []):
            out[h].append((name, tenant))
    return out


@router.get("/api/dashboard")
def dashboard_data(request: Request, _context: ConsoleDep, services: ServicesDep) -> JSONResponse:
    metrics = get_metrics(request.app)
    engine = engine_summary(metrics.engine_stats())
    adapters = []
    if engine["available"]:
        where = {h: "device" for h in engine["lora_resident"]}
        for h in engine["lora_host_cached"]:
            where.setdefault(h, "host")
        names = _adapter_names(services, set(where))
        for content_hash, level in where.items():
            for name, tenant in names.get(content_hash) or [(None, None)]:
                adapters.append({"content_hash": content_hash, "where": level, "name": name, "tenant": tenant})
        adapters.sort(key=lambda a: (a["where"] != "device", a["tenant"] or "", a["name"] or ""))
    return JSONResponse(
        {"window": metrics.recent.summary(), "engine": engine, "adapters": adapters},
        headers={"cache-control": "no-store", "x-content-type-options": SECURITY_HEADERS["x-content-type-options"]},
    )
