"""Tenants, plans, quotas, prices and API keys."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from itsdangerous import BadSignature, URLSafeTimedSerializer
from pydantic import ValidationError
from sqlalchemy import func, or_, select

from loraplex.platform.billing.money import format_micros
from loraplex.platform.billing.periods import upcoming_periods
from loraplex.platform.billing.prices import price_for_tenant, set_tenant_override, tenant_override
from loraplex.platform.billing.pricing import PriceOverride
from loraplex.platform.billing.statements import get_statement
from loraplex.platform.console import forms
from loraplex.platform.console.deps import ConsoleDep, ConsolePostDep
from loraplex.platform.console.paging import back_to, page_of
from loraplex.platform.console.session import cookie_secure
from loraplex.platform.console.templating import redirect, render
from loraplex.platform.deps import IdPath, ServicesDep
from loraplex.platform.models import ALL_SCOPES, ApiKey, Plan, Tenant, utcnow
from loraplex.platform.paging import parse_name_cursor
from loraplex.platform.schemas.messages import plain_errors
from loraplex.platform.schemas.tenants import (
    QUOTA_MAX,
    KeyCreate,
    KeyCreated,
    PlanCreate,
    PlanUpdate,
    TenantCreate,
    TenantUpdate,
)
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import (
    TenantError,
    create_api_key,
    create_plan,
    create_tenant,
    delete_plan,
    get_plan,
    get_tenant,
    key_public,
    revoke_api_key,
    tenant_public,
    update_plan,
    update_tenant,
)

router = APIRouter(route_class=StrictJsonRoute)

QUOTA_FIELDS = (
    ("requests_per_minute", "Requests per minute"),
    ("tokens_per_minute", "Tokens per minute"),
    ("max_concurrent", "Concurrent requests"),
    ("monthly_token_budget", "Monthly token budget"),
)
PRICE_FIELDS = (("prompt", "Prompt tokens"), ("completion", "Completion tokens"),
                ("adapter_surcharge", "Adapter surcharge"))


def _problem(exc: Exception) -> str:
    return plain_errors(exc) if isinstance(exc, ValidationError) else str(exc)


@router.get("/tenants", response_class=HTMLResponse)
def tenants_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    with services.sessions() as session:
        # by name (unique), a page at a time: the name is the cursor
        rows, pager = page_of(request, session, select(Tenant), Tenant.name, lambda t: t.name,
                              search_columns=(Tenant.name,), cursor=parse_name_cursor)
        tenants = [tenant_public(t, services.settings) for t in rows]
        plans = list(session.scalars(select(Plan).order_by(Plan.name)))  # the new tenant's choices
        # the plans table is paged apart from the tenants: its parameters are plans_q, plans_after, ...
        plan_rows, plan_pager = page_of(request, session, select(Plan), Plan.name, lambda p: p.name,
                                        search_columns=(Plan.name,), cursor=parse_name_cursor, prefix="plans_")
        plan_tenants = dict(session.execute(
            select(Tenant.plan_id, func.count()).where(Tenant.plan_id.in_([p.id for p in plan_rows]))
            .group_by(Tenant.plan_id)).all())
        counts = dict(session.execute(
            select(ApiKey.tenant_id, func.count(ApiKey.id))
            .where(ApiKey.tenant_id.in_([t.id for t in tenants]), ApiKey.revoked_at.is_(None),
                   or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()))
            .group_by(ApiKey.tenant_id)
        ).all())
    return render(request, "tenants.html", context, tenants=tenants, plans=plans, key_counts=counts,
                  plan_rows=plan_rows, plan_pager=plan_pager, plan_tenants=plan_tenants, quota_fields=QUOTA_FIELDS,
                  pager=pager)


@router.post("/tenants")
async def tenants_create(request: Request, _context: ConsolePostDep, services: ServicesDep) -> RedirectResponse:
    form = await request.form()
    try:
        data = TenantCreate(name=forms.text(form, "name", required=True), plan=forms.text(form, "plan"))
        with services.sessions() as session:
            tenant = create_tenant(session, data)
            session.commit()
            tenant_id = tenant.id
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, "/console/tenants", error=f"Could not create the tenant: {_problem(exc)}",
                        kept=("tenant-create", form))
    return redirect(request, f"/console/tenants/{tenant_id}", flash=f"Tenant {data.name} created.")


@router.post("/plans")
async def plans_create(request: Request, _context: ConsolePostDep, services: ServicesDep) -> RedirectResponse:
    form = await request.form()
    try:
        data = PlanCreate(name=forms.text(form, "name", required=True),
                          **_plan_quotas(form))
        with services.sessions() as session:
            create_plan(session, data)
            session.commit()
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, "/console/tenants", error=f"Could not add the plan: {_problem(exc)}",
                        kept=("plan-create", form))
    return redirect(request, "/console/tenants", flash=f"Plan {data.name} added.")


def _plan_quotas(form) -> dict[str, int]:
    """A plan form's quotas: every one is needed, within the API's range."""
    return {f: forms.positive_int(form, f, required=True, maximum=QUOTA_MAX[f]) for f, _ in QUOTA_FIELDS}


@router.post("/plans/{plan_id}")
async def plan_update(request: Request, _context: ConsolePostDep, services: ServicesDep,
                      plan_id: IdPath) -> RedirectResponse:
    """Every quota field is sent, and the name (a form without one keeps the plan's); its tenants without
    overrides take the new values at once."""
    form = await request.form()
    back = back_to(request, "/console/tenants")
    try:
        name = forms.text(form, "name", required=True) if "name" in form else None
        data = PlanUpdate(**_plan_quotas(form), **({"name": name} if name is not None else {}))
        with services.sessions() as session:
            plan = get_plan(session, plan_id)
            before = plan.name
            name = update_plan(session, plan, data).name
            session.commit()
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, back, error=f"Plan not saved: {_problem(exc)}",
                        kept=(f"plan-edit-{plan_id}", form))
    renamed = f" (renamed from {before})" if name != before else ""
    return redirect(request, back,
                    flash=f"Plan {name}{renamed} saved: its tenants have the new quotas.")


@router.post("/plans/{plan_id}/delete")
async def plan_delete(request: Request, _context: ConsolePostDep, services: ServicesDep,
                      plan_id: IdPath) -> RedirectResponse:
    back = back_to(request, "/console/tenants")
    try:
        with services.sessions() as session:
            plan = get_plan(session, plan_id)
            name = plan.name
            delete_plan(session, plan)
            session.commit()
    except TenantError as exc:
        return redirect(request, back, error=f"Plan not deleted: {exc}")
    return redirect(request, back, flash=f"Plan {name} deleted.")


def _tenant_page(request: Request, context, services, tenant_id: int, *, new_key=None, status_code=200):
    periods = upcoming_periods()
    period = request.query_params.get("period")
    period = period if period in periods else periods[0]
    with services.sessions() as session:
        try:
            tenant = get_tenant(session, tenant_id)
        except TenantError:
            return render(request, "not_found.html", context, status_code=404, what=f"tenant {tenant_id}")
        override = tenant_override(session, tenant.id, period)
        price = price_for_tenant(session, tenant, period)
        this_month = get_statement(session, tenant, periods[0])
        rows, key_pager = page_of(request, session, select(ApiKey).where(ApiKey.tenant_id == tenant.id), ApiKey.id,
                                  lambda k: k.id, search_columns=(ApiKey.name, ApiKey.prefix), descending=True)
        keys = [key_public(k) for k in rows]
        plans = list(session.scalars(select(Plan).order_by(Plan.name)))
        public = tenant_public(tenant, services.settings)
    override_values = {
        f: format_micros(getattr(override, f)) if override and getattr(override, f) is not None else ""
        for f, _ in PRICE_FIELDS
    }
    return render(
        request, "tenant.html", context, status_code=status_code, tenant=public, keys=keys, plans=plans,
        new_key=new_key, key_pager=key_pager, quota_fields=QUOTA_FIELDS, price_fields=PRICE_FIELDS, price=vars(price) | {"currency": price.currency},
        override_values=override_values, scopes=ALL_SCOPES, period=period, periods=periods, this_month=this_month,
        now=datetime.now(UTC),
    )


# A new key's secret goes from its POST to the page that shows it once in a short-lived cookie of this
# console session, not in a URL: the POST redirects (reload and Back never create a second key) and the GET
# that shows the secret deletes the cookie (a reload no longer shows it).
NEW_KEY_COOKIE = "lpx_console_new_key"
NEW_KEY_SECONDS = 120


def _new_key_signer(services, context) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(services.settings.secret_key, salt=f"console-new-key-{context.session_id}")


@router.get("/tenants/{tenant_id}", response_class=HTMLResponse)
def tenant_page(request: Request, context: ConsoleDep, services: ServicesDep, tenant_id: IdPath) -> HTMLResponse:
    raw = request.cookies.get(NEW_KEY_COOKIE)
    new_key = None
    if raw:
        try:
            shown = KeyCreated.model_validate(_new_key_signer(services, context).loads(raw, max_age=NEW_KEY_SECONDS))
            new_key = shown if shown.tenant_id == tenant_id else None
        except (BadSignature, ValidationError):
            new_key = None
    response = _tenant_page(request, context, services, tenant_id, new_key=new_key)
    if raw:
        response.delete_cookie(NEW_KEY_COOKIE, path="/console")
        response.headers["cache-control"] = "no-store"
    return response


@router.post("/tenants/{tenant_id}")
async def tenant_update(request: Request, _context: ConsolePostDep, services: ServicesDep,
                        tenant_id: IdPath) -> RedirectResponse:
    form = await request.form()
    back = f"/console/tenants/{tenant_id}"
    try:
        # every quota field is sent: empty clears the override back to the plan's value
        changes = {f: forms.positive_int(form, f, maximum=QUOTA_MAX[f]) for f, _ in QUOTA_FIELDS}
        data = TenantUpdate(plan=forms.text(form, "plan"), **changes)
        with services.sessions() as session:
            update_tenant(session, get_tenant(session, tenant_id), data)
            session.commit()
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, back, error=f"Not saved: {_problem(exc)}", kept=("tenant-edit", form))
    return redirect(request, back, flash="Plan and quotas saved.")


@router.post("/tenants/{tenant_id}/status")
async def tenant_status(request: Request, _context: ConsolePostDep, services: ServicesDep,
                        tenant_id: IdPath) -> RedirectResponse:
    form = await request.form()
    back = f"/console/tenants/{tenant_id}"
    try:
        data = TenantUpdate(status=forms.text(form, "status", required=True))
        with services.sessions() as session:
            tenant = update_tenant(session, get_tenant(session, tenant_id), data)
            session.commit()
            name, status = tenant.name, tenant.status
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, back, error=f"Not changed: {_problem(exc)}")
    verb = "suspended: its keys are refused from now on" if status == "suspended" else "active again"
    return redirect(request, back, flash=f"Tenant {name} is {verb}.")


@router.post("/tenants/{tenant_id}/prices")
async def tenant_prices(request: Request, _context: ConsolePostDep, services: ServicesDep,
                        tenant_id: IdPath) -> RedirectResponse:
    form = await request.form()
    back = f"/console/tenants/{tenant_id}"
    try:
        override = PriceOverride(**{f: forms.money(form, f) for f, _ in PRICE_FIELDS})
        period = forms.text(form, "period")
        with services.sessions() as session:
            set_tenant_override(session, get_tenant(session, tenant_id).id, override, period)
            session.commit()
    except (TenantError, forms.FormError, ValueError) as exc:
        # back on the period the prices were typed for, so that they are shown under it
        sent = form.get("period")
        again = f"{back}?period={quote(sent)}" if isinstance(sent, str) and sent else back
        return redirect(request, again, error=f"Prices not saved: {_problem(exc)}", kept=("tenant-prices", form))
    return redirect(request, f"{back}?period={period}" if period else back,
                    flash=f"Prices saved, in force from {period or 'this month'} on.")


@router.post("/tenants/{tenant_id}/keys")
async def key_create(request: Request, context: ConsolePostDep, services: ServicesDep, tenant_id: IdPath):
    form = await request.form()
    back = f"/console/tenants/{tenant_id}"
    try:
        # an empty name is refused, as the API and the CLI refuse it, rather than made "default"
        data = KeyCreate(name=forms.text(form, "name") or "",
                         scopes=[s for s in form.getlist("scopes") if isinstance(s, str)],
                         expires_at=forms.text(form, "expires_at"))
        with services.sessions() as session:
            created = create_api_key(session, services.settings, get_tenant(session, tenant_id), data)
            session.commit()
    except (TenantError, ValidationError, forms.FormError) as exc:
        return redirect(request, back, error=f"No key created: {_problem(exc)}", kept=("key-create", form))
    response = redirect(request, back)
    response.set_cookie(NEW_KEY_COOKIE, _new_key_signer(services, context).dumps(created.model_dump(mode="json")),
                        max_age=NEW_KEY_SECONDS, httponly=True, samesite="strict",
                        secure=cookie_secure(services.settings), path="/console")
    return response


@router.post("/keys/{key_id}/revoke")
async def key_revoke(request: Request, _context: ConsolePostDep, services: ServicesDep,
                     key_id: IdPath) -> RedirectResponse:
    with services.sessions() as session:
        key = session.get(ApiKey, key_id)
        if key is None:
            return redirect(request, "/console/tenants", error=f"No API key with id {key_id}.")
        revoke_api_key(session, key)
        session.commit()
        tenant_id, prefix = key.tenant_id, key.prefix
    return redirect(request, f"/console/tenants/{tenant_id}", flash=f"Key {prefix}… revoked.")
