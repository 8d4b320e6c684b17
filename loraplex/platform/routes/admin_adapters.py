"""/admin/api adapters: every tenant's adapters for operators, uploads on a tenant's behalf, prefetch and pin."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from loraplex.engine.errors import AdapterLoadError, EngineOverloadedError, InvalidRequestError
from loraplex.platform.adapter_registry import adapter_public, pin_version
from loraplex.platform.deps import AdminDep, IdPath, PageDep, RowId, ServicesDep, SessionDep
from loraplex.platform.errors import APIError, bad_request, from_engine_error, not_found
from loraplex.platform.models import Adapter, AdapterVersion, Tenant, VersionStatus
from loraplex.platform.paging import Page, fetch_page, make_page, matching
from loraplex.platform.pin_sync import prefetch_keeping_pin_honest
from loraplex.platform.routes.adapters import handle_delete, handle_upload, handle_version_delete, version_ref
from loraplex.platform.schemas.adapters import (
    AdapterDeleted,
    AdapterPublic,
    AdapterVersionDeleted,
    PrefetchRequest,
)
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import get_tenant

log = logging.getLogger(__name__)

router = APIRouter(route_class=StrictJsonRoute, prefix="/admin/api", tags=["admin"])


class TenantAdapter(AdapterPublic):
    adapter_id: int  # unique across tenants (`id` is the name, unique within its tenant): the paging cursor
    tenant_id: int
    tenant: str
    resident: bool  # in an engine device slot now


@router.get("/adapters", response_model=list[TenantAdapter] | Page[TenantAdapter])
def list_all_adapters(*, _admin: AdminDep, session: SessionDep, services: ServicesDep, page: PageDep,
                      tenant_id: RowId | None = Query(default=None)) -> list[TenantAdapter] | Page[TenantAdapter]:
    """Every adapter, by tenant name and adapter name; with a paging parameter (`limit`, `after`, `before`, `q`
    matching the adapter's name), one page ordered by `adapter_id`, the cursor."""
    stmt = (select(Adapter, Tenant.name).join(Tenant, Tenant.id == Adapter.tenant_id)
            .options(selectinload(Adapter.versions)))
    if tenant_id is not None:
        stmt = stmt.where(Adapter.tenant_id == tenant_id)
    if page.search:
        stmt = stmt.where(matching(page.search, Adapter.name))
    resident = set(services.engine.stats().lora_resident) if services.engine is not None else set()

    def public(adapter: Adapter, tenant_name: str) -> TenantAdapter:
        hashes = {v.content_hash for v in adapter.versions if v.content_hash}
        return TenantAdapter(**adapter_public(adapter).model_dump(), adapter_id=adapter.id,
                             tenant_id=adapter.tenant_id, tenant=tenant_name, resident=bool(hashes & resident))

    if not page.requested:
        return [public(*row) for row in session.execute(stmt.order_by(Tenant.name, Adapter.name))]
    rows, has_more = fetch_page(session, stmt, Adapter.id, page, scalars=False)
    return make_page([public(*row) for row in rows], has_more, lambda item: item.adapter_id)


@router.post("/tenants/{tenant_id}/adapters", response_model=None, status_code=201)
async def upload_for_tenant(*, _admin: AdminDep, services: ServicesDep, request: Request, tenant_id: IdPath,
                            wait: bool = Query(default=False)) -> JSONResponse:
    with services.sessions() as session:
        get_tenant(session, tenant_id)
    return await handle_upload(services, tenant_id, request, wait)


@router.delete("/tenants/{tenant_id}/adapters/{name}", response_model=AdapterDeleted)
async def delete_for_tenant(*, _admin: AdminDep, services: ServicesDep, tenant_id: IdPath, name: str) -> AdapterDeleted:
    return await handle_delete(services, tenant_id, name)


@router.delete("/tenants/{tenant_id}/adapters/{name}/versions/{version_id}", response_model=AdapterVersionDeleted)
async def delete_version_for_tenant(*, _admin: AdminDep, services: ServicesDep, tenant_id: IdPath, name: str,
                                    version_id: str) -> AdapterVersionDeleted:
    return await handle_version_delete(services, tenant_id, name, version_ref(version_id))


class PrefetchResult(BaseModel):
    version_id: int
    content_hash: str
    pinned: bool | None  # as asked: true pinned, false unpinned, null left as it was
    # "engine": done in the engines now; "queued": sent to the engine processes' queue; "sync": recorded, but
    # no engine could be reached now: each applies it at start or at its next pin sync (202)
    where: str


@router.post("/adapter-versions/{version_id}/prefetch", response_model=PrefetchResult)
async def prefetch_version(*, _admin: AdminDep, services: ServicesDep, version_id: IdPath, response: Response,
                           body: PrefetchRequest | None = None) -> PrefetchResult:
    body = body or PrefetchRequest()
    with services.sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:
            raise not_found(f"no adapter version {version_id}", param="version_id")
        if version.status != VersionStatus.ready.value:
            raise bad_request(f"adapter version {version_id} is {version.status}, not ready", param="version_id")
        # the pin is this version's; the engines pin the content while any of its versions is pinned
        was_pinned = version.pinned
        engine_pin = pin_version(session, version, body.pin)
        content_hash = version.content_hash
        session.commit()
    try:
        where = await prefetch_keeping_pin_honest(services, version_id, engine_pin, pin=body.pin,
                                                  was_pinned=was_pinned)
    except EngineOverloadedError as exc:  # a prefetch alone with no engine to take it: 503 as for inference
        log.warning("prefetch of adapter version %s not done: %s", version_id, exc)
        raise from_engine_error(exc) from exc
    except (AdapterLoadError, InvalidRequestError) as exc:  # the engines cannot load it: no pin recorded
        log.warning("adapter version %s could not be loaded: %s", version_id, exc)
        raise APIError(422, f"Adapter version {version_id} could not be loaded by the engine: {exc}",
                       param="version_id", code="adapter_load_failed") from exc
    if where == "sync":
        response.status_code = 202
    return PrefetchResult(version_id=version_id, content_hash=content_hash, pinned=body.pin, where=where)
