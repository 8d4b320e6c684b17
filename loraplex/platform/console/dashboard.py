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


def _adapter_names(services, hashes: set[str]) -> dict[str, list[dict]]:
    """content hash -> every (adapter, tenant) whose ready version it is: tenants who uploaded the same
    weights share one cached copy, and each of them is listed, with whether an operator pinned that version
    (a pin is each tenant's own: the copy stays pinned while any of them holds one)."""
    if not hashes:
        return {}
    with services.sessions() as session:
        rows = session.execute(
            select(AdapterVersion.content_hash, Adapter.name, Tenant.name, Tenant.id, AdapterVersion.id,
                   AdapterVersion.pinned)
            .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
            .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
            .where(AdapterVersion.content_hash.in_(sorted(hashes)),
                   AdapterVersion.status == VersionStatus.ready.value)
            .order_by(AdapterVersion.id)
        ).all()
    out: dict[str, list[dict]] = {}
    for h, name, tenant, tenant_id, version_id, pinned in rows:
        listed = out.setdefault(h, [])
        same = next((e for e in listed if (e["name"], e["tenant"]) == (name, tenant)), None)
        if same is None:
            listed.append({"name": name, "tenant": tenant, "tenant_id": tenant_id, "version_id": version_id,
                           "pinned": bool(pinned)})
        elif pinned and not same["pinned"]:  # the version to unpin is the one pinned
            same.update(version_id=version_id, pinned=True)
    return out


@router.get("/api/dashboard")
def dashboard_data(request: Request, _context: ConsoleDep, services: ServicesDep) -> JSONResponse:
    metrics = get_metrics(request.app)
    stats = metrics.engine_stats()
    engine = engine_summary(stats)
    adapters = []
    if engine["available"]:
        engine_pinned = set(stats.extra.get("lora_pinned", ()))
        where = {h: "device" for h in engine["lora_resident"]}
        for h in engine["lora_host_cached"]:
            where.setdefault(h, "host")
        names = _adapter_names(services, set(where))
        unknown = {"name": None, "tenant": None, "tenant_id": None, "version_id": None, "pinned": False}
        for content_hash, level in where.items():
            for entry in names.get(content_hash) or [unknown]:
                adapters.append({"content_hash": content_hash, "where": level, **entry,
                                 # the engine holds the copy pinned (for this version's pin or another's)
                                 "engine_pinned": content_hash in engine_pinned})
        adapters.sort(key=lambda a: (a["where"] != "device", a["tenant"] or "", a["name"] or ""))
    return JSONResponse(
        {"window": metrics.recent.summary(), "engine": engine, "adapters": adapters},
        headers={"cache-control": "no-store", "x-content-type-options": SECURITY_HEADERS["x-content-type-options"]},
    )
