"""Adapters of a tenant: upload (streamed, with progress in the browser), status and failure reasons,
versions, engine cache residency, delete, prefetch and pin."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from loraplex.platform.adapter_registry import (
    adapter_public,
    pin_version,
    uploads_root,
)
from loraplex.platform.console.deps import ConsoleDep, ConsolePostDep
from loraplex.platform.console.paging import page_of
from loraplex.platform.console.templating import redirect, render
from loraplex.platform.console.tenant_search import TENANT_MATCHES, choose_tenant, tenant_matches
from loraplex.platform.deps import IdPath, ServicesDep
from loraplex.platform.errors import APIError
from loraplex.platform.ids import parse_row_id
from loraplex.platform.metrics import get_metrics
from loraplex.platform.models import Adapter, AdapterVersion, Tenant, VersionStatus
from loraplex.platform.paging import parse_name_cursor
from loraplex.platform.routes.adapters import (
    MULTIPART_OVERHEAD,
    handle_delete,
    handle_version_delete,
    register_with_retry,
)
from loraplex.platform.schemas.adapters import parse_pin
from loraplex.platform.scoping import TenantScope
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import TenantError, get_tenant
from loraplex.platform.uploads import parse_upload, too_large

router = APIRouter(route_class=StrictJsonRoute)


def _residency(request: Request) -> tuple[set[str], set[str], set[str]]:
    stats = get_metrics(request.app).engine_stats()
    if stats is None:
        return set(), set(), set()
    return set(stats.lora_resident), set(stats.lora_host_cached), set(stats.extra.get("lora_pinned", ()))


@router.get("/adapters", response_class=HTMLResponse)
def adapters_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    """The tenant is named by `tenant_id` (links) or by `tenant`, a name typed in the page's tenant field."""
    status_code, error, matches = 200, None, ()
    with services.sessions() as session:
        raw = request.query_params.get("tenant_id")
        typed = request.query_params.get("tenant")
        if raw:
            tenant_id = parse_row_id(raw)
            tenant = session.get(Tenant, tenant_id) if tenant_id is not None else None
            if tenant is None:
                shown = raw if len(raw) <= 40 else raw[:40] + "..."
                raise HTTPException(404, f"No tenant {shown!r}.")
        elif typed is not None and typed.strip():
            choice = choose_tenant(session, typed)
            tenant, error, matches = choice.tenant, choice.error, choice.matches
            if tenant is None:
                status_code = 404
        else:
            tenant = session.scalar(select(Tenant).order_by(Tenant.name).limit(1))
        adapters = []
        pager = None
        pinned: set[int] = set()  # the versions an operator pinned (each tenant's own, whatever the content)
        if tenant is not None:
            scope = TenantScope(session, tenant.id)
            rows, pager = page_of(request, session, scope.select(Adapter).options(selectinload(Adapter.versions)),
                                  Adapter.name, lambda a: a.name, search_columns=(Adapter.name,),
                                  cursor=parse_name_cursor)
            adapters = [adapter_public(a) for a in rows]
            pinned = set(session.scalars(select(AdapterVersion.id).where(
                AdapterVersion.tenant_id == tenant.id, AdapterVersion.pinned.is_(True))))
        # the datalist starts with the first few names; the script refills it as the operator types
        suggestions = tenant_matches(session, None)
        any_tenant = bool(suggestions)
    device, host, _ = _residency(request)
    return render(request, "adapters.html", context, status_code=status_code, tenant=tenant, adapters=adapters,
                  pager=pager, device=device, host=host, pinned=pinned, engine_ready=services.engine is not None,
                  max_upload_mb=services.settings.max_upload_bytes // (1024 * 1024), tenant_error=error,
                  tenant_typed=typed.strip() if tenant is None and typed else (tenant.name if tenant else ""),
                  tenant_choices=matches, suggestions=suggestions, any_tenant=any_tenant,
                  tenant_matches_limit=TENANT_MATCHES)


@router.post("/api/tenants/{tenant_id}/adapters")
async def upload(request: Request, _context: ConsolePostDep, services: ServicesDep, tenant_id: IdPath) -> JSONResponse:
    """The same streamed, size-limited upload as POST /v1/adapters, on behalf of the tenant."""
    with services.sessions() as session:
        try:
            tenant = get_tenant(session, tenant_id)
        except TenantError as exc:
            raise HTTPException(404, str(exc)) from exc
    limit = services.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise too_large(limit)
    staging = uploads_root(services.settings) / f"incoming-{uuid.uuid4().hex}"
    parsed = await parse_upload(request.stream(), request.headers.get("content-type", ""), staging, limit)

    try:
        version_id, created, name = await asyncio.to_thread(register_with_retry, services, tenant.id, parsed)
    except BaseException:
        parsed.discard()
        raise
    if created:
        await services.tasks.send_async("loraplex.validate_adapter", version_id)
    return JSONResponse({
        "name": name, "version_id": version_id, "status": VersionStatus.pending.value if created else "existing",
        "status_url": f"/console/api/tenants/{tenant.id}/versions/{version_id}",
    }, status_code=202 if created else 200)


@router.get("/api/tenants/{tenant_id}/versions/{version_id}")
def version_status(_context: ConsoleDep, services: ServicesDep, tenant_id: IdPath, version_id: IdPath) -> JSONResponse:
    with services.sessions() as session:
        version = TenantScope(session, tenant_id).one_or_none(AdapterVersion, AdapterVersion.id == version_id)
        if version is None:
            raise HTTPException(404, f"no version {version_id} of tenant {tenant_id}")
        return JSONResponse({"name": version.adapter.name, "status": version.status, "version": version.version,
                             "failure_reason": version.error})


@router.post("/tenants/{tenant_id}/adapters/{name}/delete")
async def delete(request: Request, _context: ConsolePostDep, services: ServicesDep, tenant_id: IdPath,
                 name: str) -> RedirectResponse:
    back = f"/console/adapters?tenant_id={tenant_id}"
    try:
        await handle_delete(services, tenant_id, name)
    except APIError as exc:
        return redirect(request, back, error=exc.message)
    return redirect(request, back, flash=f"Adapter {name} deleted.")


@router.post("/tenants/{tenant_id}/adapters/{name}/versions/{version_id}/delete")
async def delete_version(request: Request, _context: ConsolePostDep, services: ServicesDep, tenant_id: IdPath,
                         name: str, version_id: IdPath) -> RedirectResponse:
    """One version, as DELETE /admin/api/tenants/{id}/adapters/{name}/versions/{id}: the adapter goes with
    its last one."""
    back = f"/console/adapters?tenant_id={tenant_id}"
    with services.sessions() as session:
        version = TenantScope(session, tenant_id).one_or_none(AdapterVersion, AdapterVersion.id == version_id)
        known = version is not None and version.version
        label = f"{name}@{version.version}" if known else f"{name} version {version_id}"
    try:
        deleted = await handle_version_delete(services, tenant_id, name, version_id)
    except APIError as exc:
        return redirect(request, back, error=exc.message)
    gone = f" It was the last version of {deleted.adapter}: the adapter is deleted too." if deleted.adapter_deleted else ""
    return redirect(request, back, flash=f"{label} deleted.{gone}")


@router.post("/tenants/{tenant_id}/versions/{version_id}/prefetch")
async def prefetch(request: Request, _context: ConsolePostDep, services: ServicesDep, tenant_id: IdPath,
                   version_id: IdPath) -> RedirectResponse:
    form = await request.form()
    # the dashboard's Unpin comes back to the dashboard; nothing else the form names is a place to go
    back = "/console/dashboard" if form.get("back") == "dashboard" else f"/console/adapters?tenant_id={tenant_id}"
    raw_pin = form.get("pin")
    try:  # no pin field (the Prefetch button) leaves the pin as it is; a value it cannot read is refused
        pin = parse_pin(raw_pin if raw_pin != "" else None)
    except ValueError as exc:
        return redirect(request, back, error=f"Nothing prefetched: pin {exc}.")
    with services.sessions() as session:
        version = TenantScope(session, tenant_id).one_or_none(AdapterVersion, AdapterVersion.id == version_id)
        if version is None:
            return redirect(request, back, error=f"Nothing prefetched: tenant {tenant_id} has no adapter version "
                                                 f"with id {version_id}.")
        if version.status != VersionStatus.ready.value:
            return redirect(request, back, error=f"Nothing prefetched: {version.adapter.name} version {version_id} "
                                                 f"is {version.status}; only a ready version can be prefetched.")
        label = f"{version.adapter.name}@{version.version}"
        was_pinned = version.pinned
        engine_pin = pin_version(session, version, pin)
        session.commit()
    from loraplex.engine.errors import AdapterLoadError, EngineOverloadedError, InvalidRequestError
    from loraplex.platform.pin_sync import prefetch_keeping_pin_honest

    try:  # straight to the engines (every engine process for a pin), as the admin API does
        where = await prefetch_keeping_pin_honest(services, version_id, engine_pin, pin=pin, was_pinned=was_pinned)
    except (AdapterLoadError, InvalidRequestError) as exc:  # as the admin API's 422: no pin recorded
        undone = {True: " and is not pinned", False: " and stays pinned"}.get(pin, "")
        return redirect(request, back, error=f"{label} could not be loaded by the engine{undone}: {exc}")
    except EngineOverloadedError as exc:
        return redirect(request, back, error=f"{label} was not loaded: {exc}")
    verb = {True: "pinned in the engine's cache", False: "unpinned: it may be evicted again"}.get(
        pin, "being loaded into the engine's cache")
    if where == "sync":
        verb += " (no engine is reachable now: each applies it when it next syncs its pins)"
    return redirect(request, back, flash=f"{label} is {verb}.")
