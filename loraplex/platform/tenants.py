"""Tenants, plans and keys: the operations shared by the admin API and the `loraplex admin` command."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.config import Settings
from loraplex.platform.billing.models import ALWAYS, TenantPlan
from loraplex.platform.billing.prices import CurrencyConflict, record_plan
from loraplex.platform.models import MAX_ROW_ID, AdminKey, ApiKey, Plan, Tenant, TenantStatus, utcnow
from loraplex.platform.quotas import QuotaLimits
from loraplex.platform.schemas.tenants import (
    EffectiveQuotas,
    KeyCreate,
    KeyCreated,
    KeyPublic,
    PlanCreate,
    PlanUpdate,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from loraplex.platform.security import display_prefix, generate_key, hash_key

_QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget")


class TenantError(ValueError):
    """A readable refusal (duplicate name, unknown plan, unknown tenant)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def effective_limits(tenant: Tenant, settings: Settings) -> QuotaLimits:
    values = {}
    for name in _QUOTA_FIELDS:
        value = getattr(tenant, name)
        if value is None and tenant.plan is not None:
            value = getattr(tenant.plan, name)
        if value is None:
            value = getattr(settings, f"default_{name}")
        values[name] = value
    return QuotaLimits(**values)


def quota_sources(tenant: Tenant) -> dict[str, str]:
    """Where each of the tenant's quotas comes from, as effective_limits resolves it: "own" (its override),
    "plan" or "default" (the service's)."""
    return {
        name: "own" if getattr(tenant, name) is not None else "plan" if tenant.plan is not None else "default"
        for name in _QUOTA_FIELDS
    }


def tenant_public(tenant: Tenant, settings: Settings) -> TenantPublic:
    limits = effective_limits(tenant, settings)
    return TenantPublic(
        id=tenant.id, name=tenant.name, status=tenant.status, plan=tenant.plan.name if tenant.plan else None,
        created_at=tenant.created_at, quotas=EffectiveQuotas(**vars(limits)),
        **{f: getattr(tenant, f) for f in _QUOTA_FIELDS},
    )


def key_public(key: ApiKey) -> KeyPublic:
    return KeyPublic(id=key.id, tenant_id=key.tenant_id, name=key.name, prefix=key.prefix,
                     scopes=sorted(key.scope_set), created_at=key.created_at, revoked_at=key.revoked_at,
                     expires_at=key.expires_at, last_used_at=key.last_used_at)


def key_state(key: ApiKey, now: datetime | None = None) -> str:
    """What a key's listing says of it: active (until when), revoked or expired (when)."""
    if key.revoked_at is not None:
        return f"revoked {key.revoked_at:%Y-%m-%d %H:%M}"
    if key.expires_at is None:
        return "active"
    expires = key.expires_at.astimezone(UTC)
    if expires <= (now or datetime.now(UTC)):
        return f"expired {expires:%Y-%m-%d %H:%M}"
    return f"active until {expires:%Y-%m-%d %H:%M} UTC"


def _same_name(session: Session, model: type[Plan] | type[Tenant], name: str, *,
               other_than: int | None = None) -> str | None:
    """The name of the plan or tenant already called `name` whatever its case (names are ASCII, so lower()
    agrees with the unique index on lower(name) in either database), or None."""
    stmt = select(model.name).where(func.lower(model.name) == name.lower())
    if other_than is not None:
        stmt = stmt.where(model.id != other_than)
    return session.scalar(stmt.limit(1))


def _name_taken(kind: str, name: str, existing: str | None = None) -> TenantError:
    if existing is None:  # found by the database's unique index: a concurrent create or rename
        message = f"a {kind} named {name!r}, or one differing from it only in case, already exists"
    elif existing == name:
        message = f"a {kind} named {name!r} already exists"
    else:
        message = (f"a {kind} named {existing!r} already exists, and {kind} names are unique whatever their case: "
                   f"choose a name other than {name!r}")
    return TenantError(message, status=409, param="name")


def _plan_by_name(session: Session, name: str) -> Plan:
    plan = session.scalar(select(Plan).where(Plan.name == name))
    if plan is None:
        known = session.scalars(select(Plan.name)).all()
        raise TenantError(f"unknown plan {name!r}; known plans: {', '.join(known) or '(none)'}", param="plan")
    return plan


def create_plan(session: Session, data: PlanCreate) -> Plan:
    existing = _same_name(session, Plan, data.name)
    if existing is not None:
        raise _name_taken("plan", data.name, existing)
    plan = Plan(**data.model_dump())
    session.add(plan)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create with the same name
        raise _name_taken("plan", data.name) from exc
    return plan


def get_plan(session: Session, ref: int | str) -> Plan:
    """By id (the admin API's way), or by name (the CLI's and the console's)."""
    if isinstance(ref, int):
        plan = session.get(Plan, ref) if 1 <= ref <= MAX_ROW_ID else None
        if plan is None:
            raise TenantError(f"no plan with id {ref}", status=404, param="plan_id")
        return plan
    return _plan_by_name(session, ref)


def update_plan(session: Session, plan: Plan, data: PlanUpdate) -> Plan:
    """Change a plan's quotas (or its name). Its tenants take the new values from their next request on,
    wherever they have no override of their own: every request reads its limits from the database."""
    changes = data.model_dump(exclude_unset=True)
    nulls = [name for name, value in changes.items() if value is None]
    if nulls:
        why = "a plan has a name" if nulls[0] == "name" else "a plan's tenants fall back on its quotas"
        raise TenantError(f"{nulls[0]} cannot be null: {why}", param=nulls[0])
    name = changes.get("name")
    if name is not None and name != plan.name:  # a new case of its own name is still its own
        existing = _same_name(session, Plan, name, other_than=plan.id)
        if existing is not None:
            raise _name_taken("plan", name, existing)
    for field, value in changes.items():
        setattr(plan, field, value)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create or rename to the same name
        raise _name_taken("plan", name) from exc
    return plan


def _listed(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def delete_plan(session: Session, plan: Plan) -> None:
    """Delete a plan no tenant is on and no month of a tenant's plan history is billed at. Refused (409) while
    tenants are on it, and also while a tenant's plan history refers to it: months are billed at the plan the
    tenant was on in them, so deleting the plan (its prices go with it) would re-price those months' statements
    and reports at the no-plan list. A plan joined and left within one month is not in the history: a plan
    change applies to the whole month, which is billed at the plan the tenant ended it on."""
    on_it = list(session.scalars(select(Tenant.name).where(Tenant.plan_id == plan.id).order_by(Tenant.name)))
    if on_it:
        raise TenantError(f"plan {plan.name!r} has {len(on_it)} tenant(s): {_listed(on_it)}; move them to another "
                          "plan first", status=409, param="plan")
    history = list(session.scalars(
        select(Tenant.name).join(TenantPlan, TenantPlan.tenant_id == Tenant.id)
        .where(TenantPlan.plan_id == plan.id).distinct().order_by(Tenant.name)))
    if history:
        raise TenantError(f"plan {plan.name!r} is in the plan history of {len(history)} tenant(s): "
                          f"{_listed(history)}; the months they were on it are billed at its prices, so it is kept",
                          status=409, param="plan")
    session.delete(plan)
    session.flush()


def create_tenant(session: Session, data: TenantCreate) -> Tenant:
    existing = _same_name(session, Tenant, data.name)
    if existing is not None:
        raise _name_taken("tenant", data.name, existing)
    tenant = Tenant(name=data.name, **{f: getattr(data, f) for f in _QUOTA_FIELDS})
    if data.plan is not None:
        tenant.plan = _plan_by_name(session, data.plan)
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create with the same name
        raise _name_taken("tenant", data.name) from exc
    session.add(TenantPlan(tenant_id=tenant.id, effective_period=ALWAYS, plan_id=tenant.plan_id))
    session.flush()
    return tenant


def get_tenant(session: Session, ref: int | str) -> Tenant:
    """By id, or by name (the CLI's way of naming tenants)."""
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isascii() and ref.isdigit()):
        # an id past what the column holds names no tenant (and would overflow SQLite's binding)
        tenant = session.get(Tenant, int(ref)) if 1 <= int(ref) <= MAX_ROW_ID else None
    else:
        tenant = session.scalar(select(Tenant).where(Tenant.name == ref))
    if tenant is None:
        raise TenantError(f"no tenant {ref!r}", status=404, param="tenant")
    return tenant


def update_tenant(session: Session, tenant: Tenant, data: TenantUpdate) -> Tenant:
    changes = data.model_dump(exclude_unset=True)
    if "plan" in changes:
        plan = _plan_by_name(session, changes["plan"]) if changes["plan"] else None
        try:
            record_plan(session, tenant, plan.id if plan is not None else None)
        except CurrencyConflict as exc:
            raise TenantError(str(exc), status=409, param="plan") from exc
        session.expire(tenant, ["plan"])
        changes.pop("plan")
    if "status" in changes:
        if changes["status"] is None:
            raise TenantError("status cannot be null", param="status")
        tenant.status = TenantStatus(changes.pop("status")).value
    for name, value in changes.items():
        setattr(tenant, name, value)
    session.flush()
    return tenant


def create_api_key(session: Session, settings: Settings, tenant: Tenant, data: KeyCreate) -> KeyCreated:
    secret = generate_key()
    key = ApiKey(tenant_id=tenant.id, name=data.name, prefix=display_prefix(secret),
                 key_hash=hash_key(settings.secret_key, secret), scopes=" ".join(data.scopes),
                 expires_at=data.expires_at)
    session.add(key)
    session.flush()
    return KeyCreated(key=secret, **key_public(key).model_dump())


def revoke_api_key(session: Session, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


class LastAdminKey(TenantError):
    """Revoking this key would leave no active admin key: nobody could use the admin API or the console until
    an operator made one from the command line."""

    def __init__(self, key: AdminKey):
        super().__init__(f"admin key {key.id} ({key.prefix}...) is the last active admin key, and revoking it would "
                         "lock everyone out of the admin API and the console; create another admin key first "
                         "(`loraplex admin create-admin-key`), then revoke this one", status=409, param="key_id")


def revoke_admin_key(session: Session, key_id: int, *, allow_last: bool = False) -> AdminKey:
    """Revoke an admin key: every check of it (the admin API, console sessions made with it) fails from the
    next request on. The last active one is refused (LastAdminKey) unless `allow_last` (the CLI's --force,
    whose operator can make a new one at once)."""
    key = session.get(AdminKey, key_id)
    if key is None:
        raise TenantError(f"no admin key with id {key_id}")
    if key.revoked_at is not None:
        return key
    now = utcnow()
    revoke = update(AdminKey).where(AdminKey.id == key_id, AdminKey.revoked_at.is_(None))
    if not allow_last:
        # the active keys locked (PostgreSQL) so that two revocations at once cannot each leave the other's key
        # as the last and then revoke it; the count is checked in the update itself too (SQLite, which has no
        # row locks, runs one writer at a time)
        active = session.scalars(select(AdminKey.id).where(AdminKey.revoked_at.is_(None)).with_for_update()).all()
        others = select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None),
                                                                  AdminKey.id != key_id).scalar_subquery()
        if not any(i != key_id for i in active):
            raise LastAdminKey(key)
        revoke = revoke.where(others > 0)
    if session.execute(revoke.values(revoked_at=now).execution_options(synchronize_session=False)).rowcount == 0:
        session.refresh(key)
        if key.revoked_at is None:
            raise LastAdminKey(key)
        return key
    session.refresh(key)
    return key


def active_admin_keys(session: Session) -> int:
    from sqlalchemy import func

    return int(session.scalar(select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None))))


def create_admin_key(session: Session, settings: Settings, name: str = "admin") -> tuple[AdminKey, str]:
    secret = generate_key(admin=True)
    key = AdminKey(name=name, prefix=display_prefix(secret), key_hash=hash_key(settings.secret_key, secret))
    session.add(key)
    session.flush()
    return key, secret
