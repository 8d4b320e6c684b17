"""/admin/api: operators manage plans, tenants and keys with the admin credential.

The lists answer a bare JSON array of every row, as they always have, unless a paging parameter (`limit`,
`after`, `before`, `q`) is sent: then one page, `{"object": "list", "data", "first_id", "last_id", "has_more"}`,
ordered by id.
"""

from __future__ import annotations

from fastapi import APIRouter, status
from sqlalchemy import select

from loraplex.platform.deps import AdminDep, IdPath, PageDep, ServicesDep, SessionDep
from loraplex.platform.errors import not_found
from loraplex.platform.models import AdminKey, ApiKey, Plan, Tenant
from loraplex.platform.paging import Page, PageParams, fetch_page, make_page, matching
from loraplex.platform.schemas.tenants import (
    AdminKeyPublic,
    KeyCreate,
    KeyCreated,
    KeyPublic,
    PlanCreate,
    PlanPublic,
    PlanUpdate,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import (
    create_api_key,
    create_plan,
    create_tenant,
    delete_plan,
    get_plan,
    get_tenant,
    key_public,
    revoke_admin_key,
    revoke_api_key,
    tenant_public,
    update_plan,
    update_tenant,
)

router = APIRouter(route_class=StrictJsonRoute, prefix="/admin/api", tags=["admin"])


def _listed(session, stmt, key, page: PageParams, public):
    """The bare list of every row (no paging parameter sent), or one page of them."""
    if not page.requested:
        return [public(row) for row in session.scalars(stmt.order_by(key))]
    rows, has_more = fetch_page(session, stmt, key, page)
    return make_page([public(row) for row in rows], has_more, lambda item: item.id)


@router.get("/plans", response_model=list[PlanPublic] | Page[PlanPublic])
def list_plans(*, _admin: AdminDep, session: SessionDep, page: PageDep) -> list[PlanPublic] | Page[PlanPublic]:
    """`q` matches the plan's name."""
    stmt = select(Plan)
    if page.search:
        stmt = stmt.where(matching(page.search, Plan.name))
    return _listed(session, stmt, Plan.id, page, PlanPublic.model_validate)


@router.post("/plans", response_model=PlanPublic, status_code=status.HTTP_201_CREATED)
def add_plan(*, _admin: AdminDep, session: SessionDep, body: PlanCreate) -> Plan:
    return create_plan(session, body)


@router.patch("/plans/{plan_id}", response_model=PlanPublic)
def edit_plan(*, _admin: AdminDep, session: SessionDep, plan_id: IdPath, body: PlanUpdate) -> Plan:
    """Its tenants without overrides of their own take the new quotas from their next request on."""
    return update_plan(session, get_plan(session, plan_id), body)


@router.delete("/plans/{plan_id}", response_model=PlanPublic)
def remove_plan(*, _admin: AdminDep, session: SessionDep, plan_id: IdPath) -> PlanPublic:
    """409 while any tenant is on the plan or its plan history refers to it (see delete_plan)."""
    plan = get_plan(session, plan_id)
    deleted = PlanPublic.model_validate(plan)
    delete_plan(session, plan)
    return deleted


@router.get("/tenants", response_model=list[TenantPublic] | Page[TenantPublic])
def list_tenants(*, _admin: AdminDep, session: SessionDep, services: ServicesDep,
                 page: PageDep) -> list[TenantPublic] | Page[TenantPublic]:
    """`q` matches the tenant's name."""
    stmt = select(Tenant)
    if page.search:
        stmt = stmt.where(matching(page.search, Tenant.name))
    return _listed(session, stmt, Tenant.id, page, lambda t: tenant_public(t, services.settings))


@router.post("/tenants", response_model=TenantPublic, status_code=status.HTTP_201_CREATED)
def add_tenant(*, _admin: AdminDep, session: SessionDep, services: ServicesDep, body: TenantCreate) -> TenantPublic:
    return tenant_public(create_tenant(session, body), services.settings)


@router.get("/tenants/{tenant_id}", response_model=TenantPublic)
def read_tenant(*, _admin: AdminDep, session: SessionDep, services: ServicesDep, tenant_id: IdPath) -> TenantPublic:
    return tenant_public(get_tenant(session, tenant_id), services.settings)


@router.patch("/tenants/{tenant_id}", response_model=TenantPublic)
def edit_tenant(*, _admin: AdminDep, session: SessionDep, services: ServicesDep, tenant_id: IdPath,
                body: TenantUpdate) -> TenantPublic:
    return tenant_public(update_tenant(session, get_tenant(session, tenant_id), body), services.settings)


@router.get("/tenants/{tenant_id}/keys", response_model=list[KeyPublic] | Page[KeyPublic])
def list_keys(*, _admin: AdminDep, session: SessionDep, tenant_id: IdPath,
              page: PageDep) -> list[KeyPublic] | Page[KeyPublic]:
    """`q` matches the key's name or its display prefix."""
    tenant = get_tenant(session, tenant_id)
    stmt = select(ApiKey).where(ApiKey.tenant_id == tenant.id)
    if page.search:
        stmt = stmt.where(matching(page.search, ApiKey.name, ApiKey.prefix))
    return _listed(session, stmt, ApiKey.id, page, key_public)


@router.post("/tenants/{tenant_id}/keys", response_model=KeyCreated, status_code=status.HTTP_201_CREATED)
def add_key(*, _admin: AdminDep, session: SessionDep, services: ServicesDep, tenant_id: IdPath,
            body: KeyCreate) -> KeyCreated:
    return create_api_key(session, services.settings, get_tenant(session, tenant_id), body)


@router.delete("/keys/{key_id}", response_model=KeyPublic)
def revoke_key(*, _admin: AdminDep, session: SessionDep, key_id: IdPath) -> KeyPublic:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise not_found(f"no API key with id {key_id}", param="key_id")
    return key_public(revoke_api_key(session, key))


@router.get("/admin-keys", response_model=list[AdminKeyPublic] | Page[AdminKeyPublic])
def list_admin_keys(*, _admin: AdminDep, session: SessionDep,
                    page: PageDep) -> list[AdminKeyPublic] | Page[AdminKeyPublic]:
    """`q` matches the key's name or its display prefix."""
    stmt = select(AdminKey)
    if page.search:
        stmt = stmt.where(matching(page.search, AdminKey.name, AdminKey.prefix))
    return _listed(session, stmt, AdminKey.id, page, lambda k: AdminKeyPublic.model_validate(k, from_attributes=True))


@router.delete("/admin-keys/{key_id}", response_model=AdminKeyPublic)
def revoke_admin(*, _admin: AdminDep, session: SessionDep, key_id: IdPath) -> AdminKey:
    """Revoke an admin key (this request's own too: it is refused from the next request on). The last active
    admin key is refused with a 409: revoking it would lock everyone out of the admin API and the console."""
    if session.get(AdminKey, key_id) is None:
        raise not_found(f"no admin key with id {key_id}", param="key_id")
    return revoke_admin_key(session, key_id)
