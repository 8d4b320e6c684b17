"""Who is calling: a tenant's API key (with scopes) or the admin credential."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, bindparam, select
from sqlalchemy.orm import Session

from loraplex.config import Settings
from loraplex.platform.errors import APIError, forbidden, unauthorized
from loraplex.platform.hot_query import HotQuery
from loraplex.platform.models import AdminKey, ApiKey, Plan, Tenant, TenantStatus
from loraplex.platform.quotas import QuotaLimits
from loraplex.platform.security import ADMIN_KEY_PREFIX, KEY_PREFIX, hash_key
from loraplex.platform.tenants import effective_limits


@dataclass(frozen=True)
class TenantContext:
    """The authenticated caller, detached from any session so async code can hold it freely."""

    tenant_id: int
    tenant_name: str
    key_id: int
    scopes: frozenset[str]
    limits: QuotaLimits


@dataclass(frozen=True)
class AdminContext:
    key_id: int
    name: str


def _masked(token: str) -> str:
    return token[:8] + "*" * 8 + token[-4:] if len(token) > 16 else "****"


def _refuse_expired(prefix: str, expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= datetime.now(UTC):
        raise APIError(401, f"The API key {prefix}... expired at {expires_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC; "
                       "ask for a new one.", type="authentication_error", code="api_key_expired",
                       headers={"www-authenticate": "Bearer"})


def authenticate_tenant(session: Session, settings: Settings, token: str | None) -> TenantContext:
    if token is None:
        raise unauthorized("You didn't provide an API key. Pass it in the Authorization header as "
                           "'Authorization: Bearer lpx_...'.")
    if token.startswith(ADMIN_KEY_PREFIX):
        # the admin key reaches the admin API only; said so, as the admin API says it of a tenant key
        raise unauthorized("This endpoint needs a tenant's API key, not the admin key: create one with "
                           "'loraplex admin create-key TENANT' or POST /admin/api/tenants/{id}/keys.")
    if not token.startswith(KEY_PREFIX):
        raise unauthorized(f"Incorrect API key provided: {_masked(token)}.")
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(settings.secret_key, token)))
    if key is None:
        raise unauthorized(f"Incorrect API key provided: {_masked(token)}.")
    if key.revoked_at is not None:
        raise unauthorized(f"The API key {key.prefix}... has been revoked.")
    _refuse_expired(key.prefix, key.expires_at)
    tenant = key.tenant
    if tenant.status != TenantStatus.active:
        raise forbidden(f"Tenant {tenant.name!r} is {tenant.status}.", code="tenant_suspended")
    return TenantContext(tenant_id=tenant.id, tenant_name=tenant.name, key_id=key.id,
                         scopes=key.scope_set, limits=effective_limits(tenant, settings))


_TENANT_BY_KEY = HotQuery(
    select(ApiKey.id, ApiKey.prefix, ApiKey.scopes, ApiKey.revoked_at, ApiKey.expires_at, Tenant.id, Tenant.name,
           Tenant.status,
           Tenant.requests_per_minute, Tenant.tokens_per_minute, Tenant.max_concurrent,
           Tenant.monthly_token_budget, Plan.requests_per_minute, Plan.tokens_per_minute, Plan.max_concurrent,
           Plan.monthly_token_budget)
    .join(Tenant, Tenant.id == ApiKey.tenant_id)
    .outerjoin(Plan, Plan.id == Tenant.plan_id)
    .where(ApiKey.key_hash == bindparam("key_hash"))
)


def authenticate_tenant_fast(db: Engine, settings: Settings, token: str | None) -> TenantContext:
    """authenticate_tenant in one query (no ORM objects, no Core execution): the per-request path of every
    API call."""
    if token is None or not token.startswith(KEY_PREFIX) or token.startswith(ADMIN_KEY_PREFIX):
        with Session(db) as session:
            return authenticate_tenant(session, settings, token)  # for its exact error message
    row = _TENANT_BY_KEY.first(db, key_hash=hash_key(settings.secret_key, token))
    if row is None:
        raise unauthorized(f"Incorrect API key provided: {_masked(token)}.")
    (key_id, prefix, scopes, revoked_at, expires_at, tenant_id, tenant_name, status, *quotas) = row
    if revoked_at is not None:
        raise unauthorized(f"The API key {prefix}... has been revoked.")
    _refuse_expired(prefix, expires_at)
    if status != TenantStatus.active:
        raise forbidden(f"Tenant {tenant_name!r} is {status}.", code="tenant_suspended")
    own, plan = quotas[:4], quotas[4:]
    names = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget")
    limits = QuotaLimits(**{
        name: own[i] if own[i] is not None else plan[i] if plan[i] is not None else getattr(settings, f"default_{name}")
        for i, name in enumerate(names)
    })
    return TenantContext(tenant_id=tenant_id, tenant_name=tenant_name, key_id=key_id,
                         scopes=frozenset(scopes.split()), limits=limits)


def authenticate_admin(session: Session, settings: Settings, token: str | None) -> AdminContext:
    if token is None:
        raise unauthorized("The admin API needs the admin key: 'Authorization: Bearer lpx_admin_...'.")
    if not token.startswith(ADMIN_KEY_PREFIX):
        raise unauthorized("This endpoint needs the admin key, not a tenant key.")
    key = session.scalar(select(AdminKey).where(AdminKey.key_hash == hash_key(settings.secret_key, token)))
    if key is None:
        raise unauthorized(f"Incorrect admin key provided: {_masked(token)}.")
    if key.revoked_at is not None:
        raise unauthorized(f"The admin key {key.prefix}... has been revoked; use another admin key "
                           "(`loraplex admin create-admin-key` makes one).")
    return AdminContext(key_id=key.id, name=key.name)


def require_scope(context: TenantContext, scope: str) -> TenantContext:
    if scope not in context.scopes:
        raise forbidden(f"This API key lacks the '{scope}' scope (it has: {', '.join(sorted(context.scopes))}).",
                        code="missing_scope")
    return context
