"""Usage (charts, tables, export) and billing (price lists, statements) pages."""

from __future__ import annotations

import json
from datetime import date
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from sqlalchemy import select

from loraplex.platform.billing.adapter_filter import (
    AdapterFilter,
    UnknownAdapter,
    check_known,
    parse_adapter_filter,
)
from loraplex.platform.billing.export import statement_dict, statements_summary_csv
from loraplex.platform.billing.models import BASE_ADAPTER
from loraplex.platform.billing.periods import (
    days_in,
    parse_day,
    parse_period,
    period_of,
    previous_period,
    resolve_range,
    today_utc,
    upcoming_periods,
)
from loraplex.platform.billing.prices import price_lists, set_plan_price
from loraplex.platform.billing.pricing import Price, known_currency
from loraplex.platform.billing.reports import DIMENSIONS, parse_group_by, usage_report
from loraplex.platform.billing.responses import Format, report_response, statement_response
from loraplex.platform.billing.statements import (
    NoStatement,
    finalize_period,
    get_statement,
    is_closed,
    statement_of,
    tenants_of_period,
)
from loraplex.platform.console import forms
from loraplex.platform.console.deps import ConsoleDep, ConsolePostDep
from loraplex.platform.console.templating import redirect, render
from loraplex.platform.deps import IdPath, ServicesDep
from loraplex.platform.ids import parse_row_id
from loraplex.platform.models import ApiKey, Tenant
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import TenantError, get_tenant

router = APIRouter(route_class=StrictJsonRoute)


def _parse_date(q, name: str) -> date | None:
    """A day from the query, or a message that shows what a day looks like (not Python's "Invalid isoformat")."""
    value = q.get(name)
    if not value:
        return None
    try:
        return parse_day(value)
    except ValueError as exc:
        raise ValueError(f"{name} {exc}") from None


def _filters(request: Request) -> tuple[date, date, int | None]:
    start, end = _date_filter(request)
    return start, end, _tenant_filter(request)


def _date_filter(request: Request) -> tuple[date, date]:
    q = request.query_params
    start, end = _parse_date(q, "start"), _parse_date(q, "end")
    try:
        return resolve_range(start, end)
    except ValueError as exc:
        raise ValueError(f"Bad date range: {exc}") from exc


def _tenant_filter(request: Request) -> int | None:
    tenant = request.query_params.get("tenant_id")
    tenant_id = parse_row_id(tenant)
    if tenant and tenant_id is None:
        # never widen a filter that cannot be read (0 included) to every tenant
        shown = tenant if len(tenant) <= 40 else tenant[:40] + "..."
        raise ValueError(f"tenant_id must be a tenant's numeric id, got {shown!r}")
    return tenant_id


def _export_format(request: Request) -> Format:
    fmt = request.query_params.get("format") or "json"
    if fmt not in ("csv", "json"):
        raise ValueError(f"format must be csv or json, got {fmt!r}")
    return fmt


# What the page's adapter field takes for the base model alone (the API's empty `adapter`): no adapter name
# has a space, so it names no adapter
BASE_MODEL_LABEL = "base model"
DEFAULT_EXPORT_GROUPS = ("day", "tenant", "adapter")


def _adapter_text(request: Request) -> str | None:
    text = (request.query_params.get("adapter") or "").strip()
    if not text:
        return None
    return BASE_ADAPTER if text.lower() == BASE_MODEL_LABEL else text


def _adapter_filter(session, text: str | None, tenant_ids: list[int] | None) -> AdapterFilter | None:
    """The adapter filter, or ValueError in words (malformed, or naming no adapter of the tenants shown)."""
    if text is None:
        return None
    try:
        wanted = parse_adapter_filter(text)
        check_known(session, wanted, tenant_ids)
    except UnknownAdapter as exc:
        raise ValueError(str(exc).rstrip(".")) from None
    except ValueError as exc:
        raise ValueError(f"adapter {exc}") from None
    return wanted


def _key_filter(request: Request) -> int | None:
    text = request.query_params.get("api_key_id")
    key_id = parse_row_id(text)
    if text and key_id is None:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"api_key_id must be an API key's numeric id, got {shown!r}")
    return key_id


def _key_of(session, key_id: int | None, tenant_id: int | None) -> ApiKey | None:
    """The key a filter names, or ValueError when there is none, or it is another tenant's than the one shown."""
    if key_id is None:
        return None
    key = session.get(ApiKey, key_id)
    if key is None:
        raise ValueError(f"There is no API key {key_id}")
    if tenant_id is not None and key.tenant_id != tenant_id:
        raise ValueError(f"API key {key_id} ({key.prefix}…) is not one of the tenant's keys")
    return key


def _export_groups(request: Request) -> tuple[str, ...]:
    """The export's group_by: a comma list, or one value per ticked box on the page; the default when none."""
    text = ",".join(request.query_params.getlist("group_by"))
    if not text.strip(", "):
        return DEFAULT_EXPORT_GROUPS
    try:
        dims = parse_group_by(text)
    except ValueError:
        dims = ()
    if not dims:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"group_by takes some of {', '.join(DIMENSIONS)}, got {shown!r}")
    return dims


@router.get("/usage", response_class=HTMLResponse)
def usage_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    # a filter that cannot be read is said so and falls back to its default; the others are kept (a typo in
    # a date does not widen a tenant's page to every tenant's usage)
    errors = []
    try:
        start, end = _date_filter(request)
    except ValueError as exc:
        start, end = resolve_range(None, None)
        errors.append(f"{exc}; showing {start} to {end}.")
    try:
        tenant_id = _tenant_filter(request)
    except ValueError as exc:
        tenant_id = None
        errors.append(f"{exc}; showing all tenants.")
    try:
        key_id = _key_filter(request)
    except ValueError as exc:
        key_id = None
        errors.append(f"{exc}; showing every key's usage.")
    try:
        groups = _export_groups(request)
    except ValueError as exc:
        groups = DEFAULT_EXPORT_GROUPS
        errors.append(f"{exc}; the export groups by {', '.join(groups)}.")
    adapter_text = _adapter_text(request)
    with services.sessions() as session:
        tenants = list(session.scalars(select(Tenant).order_by(Tenant.name)))
        if tenant_id and all(t.id != tenant_id for t in tenants):
            # all zeros under a select that reads "All tenants" would say the wrong thing
            errors.append(f"There is no tenant {tenant_id}; showing all tenants.")
            tenant_id = None
        try:
            key = _key_of(session, key_id, tenant_id)
        except ValueError as exc:
            key, key_id = None, None
            errors.append(f"{exc}; showing every key's usage.")
        if key is not None and tenant_id is None:
            tenant_id = key.tenant_id  # a key is one tenant's: its usage is that tenant's
        tenant_ids = [tenant_id] if tenant_id else None
        try:
            adapter = _adapter_filter(session, adapter_text, tenant_ids)
        except ValueError as exc:
            adapter, adapter_text = None, None
            errors.append(f"{exc}; showing every adapter's usage.")
        filters = {"tenant_ids": tenant_ids, "adapter": adapter, "api_key_id": key_id}
        by_day = usage_report(session, start, end, group_by=("day",), **filters)
        by_adapter = usage_report(session, start, end, group_by=("adapter",), **filters)
        by_tenant = usage_report(session, start, end, group_by=("tenant", "adapter"), **filters)
        by_key = usage_report(session, start, end, group_by=("key",), **filters) if tenant_id else []
        keys = list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id))) \
            if tenant_id else []
    per_day = {r.day: r for r in by_day}
    chart_data = {
        # every day of the range, zeros included, so the time axis has no gaps
        "by_day": [{"day": d.isoformat(), "prompt_tokens": per_day[d].prompt_tokens if d in per_day else 0,
                    "completion_tokens": per_day[d].completion_tokens if d in per_day else 0}
                   for d in days_in(start, end)],
        "by_adapter": [{"adapter": r.adapter, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}
                       for r in by_adapter],
    }
    shown_adapter = "" if adapter is None else BASE_MODEL_LABEL if adapter.name == BASE_ADAPTER else adapter.label
    return render(
        request, "usage.html", context, tenants=tenants, start=start, end=end, tenant_id=tenant_id,
        keys=keys, api_key_id=key_id, adapter=shown_adapter, groups=groups, dimensions=DIMENSIONS,
        adapter_names=sorted({r.adapter for r in by_adapter if r.adapter}), base_model_label=BASE_MODEL_LABEL,
        by_day=by_day, by_adapter=by_adapter, by_tenant=by_tenant, by_key=by_key, error=" ".join(errors) or None,
        # </script> cannot appear: json.dumps escapes "/" only if asked, so escape "<" instead
        chart_json=json.dumps(chart_data).replace("<", "\\u003c"),
        totals={
            "requests": sum(r.requests for r in by_day), "prompt": sum(r.prompt_tokens for r in by_day),
            "completion": sum(r.completion_tokens for r in by_day), "amounts": by_currency(by_tenant),
        },
    )


@router.get("/usage/export")
def usage_export(request: Request, _context: ConsoleDep, services: ServicesDep) -> Response:
    try:
        start, end, tenant_id = _filters(request)
        fmt = _export_format(request)
        dims = _export_groups(request)
        key_id = _key_filter(request)
    except ValueError as exc:
        return Response(f"{exc}\n", status_code=400, media_type="text/plain; charset=utf-8")
    with services.sessions() as session:
        try:
            if tenant_id is not None:
                get_tenant(session, tenant_id)
            _key_of(session, key_id, tenant_id)
            tenant_ids = [tenant_id] if tenant_id else None
            adapter = _adapter_filter(session, _adapter_text(request), tenant_ids)
        except (TenantError, ValueError) as exc:
            return Response(f"{str(exc).rstrip('.')}.\n", status_code=400, media_type="text/plain; charset=utf-8")
        rows = usage_report(session, start, end, group_by=dims, tenant_ids=tenant_ids, adapter=adapter,
                            api_key_id=key_id)
    return _private(report_response(rows, dims, start, end, fmt, "usage", download=True))


@router.get("/billing", response_class=HTMLResponse)
def billing_page(request: Request, context: ConsoleDep, services: ServicesDep) -> HTMLResponse:
    period = request.query_params.get("period") or period_of(today_utc())
    try:
        parse_period(period)
    except ValueError as exc:
        return redirect(request, "/console/billing", error=f"Not a period: {exc} (use YYYY-MM).")
    with services.sessions() as session:
        tenants = sorted(tenants_of_period(session, period), key=lambda t: t.name)
        views = [get_statement(session, t, period) for t in tenants]
        prices = price_lists(session, period)
    # the period shown is always among the choices, however far from today (the select must not name another)
    periods = sorted(set(_recent_periods(12)) | set(upcoming_periods()) | {period}, reverse=True)
    totals: dict[str, int] = {}
    for v in views:  # per currency: plans may be priced in different ones
        totals[v.currency] = totals.get(v.currency, 0) + v.total_amount
    return render(request, "billing.html", context, period=period, periods=periods, statements=views,
                  prices=prices, closed=is_closed(period), totals=sorted(totals.items()))


@router.get("/billing/export")
def billing_export(request: Request, _context: ConsoleDep, services: ServicesDep) -> Response:
    period = request.query_params.get("period") or period_of(today_utc())
    try:
        fmt = _export_format(request)
        parse_period(period)  # before it names a file in a header
    except ValueError as exc:
        return Response(f"{exc}\n", status_code=400, media_type="text/plain; charset=utf-8")
    with services.sessions() as session:
        views = [get_statement(session, t, period)
                 for t in sorted(tenants_of_period(session, period), key=lambda t: t.name)]
    if fmt == "csv":
        return _private(Response(statements_summary_csv(views), media_type="text/csv; charset=utf-8",
                                 headers={"content-disposition": f'attachment; filename="statements-{period}.csv"'}))
    return _private(JSONResponse({"object": "list", "period": period, "data": [statement_dict(v) for v in views]},
                                 headers={"content-disposition": f'attachment; filename="statements-{period}.json"'}))


def _private(response: Response) -> Response:
    """An export holds tenants' usage and money, as the pages do: no browser or proxy keeps a copy of it
    (one left in a shared machine's cache after signing out), as no console page is kept."""
    response.headers["cache-control"] = "no-store"
    response.headers["x-content-type-options"] = "nosniff"
    return response


def by_currency(rows) -> list[tuple[str, int]]:
    """(currency, amount) over report rows, per currency: amounts in different currencies never add up."""
    totals: dict[str, int] = {}
    for row in rows:
        for currency, amount in row.amounts.items():
            totals[currency] = totals.get(currency, 0) + amount
    return sorted(totals.items())


def _recent_periods(n: int) -> list[str]:
    out, day = [], today_utc()
    for _ in range(n):
        out.append(period_of(day))
        day = day.replace(day=1)
        day = date.fromordinal(day.toordinal() - 1)
    return out


@router.post("/billing/prices")
async def billing_prices(request: Request, _context: ConsolePostDep, services: ServicesDep) -> RedirectResponse:
    form = await request.form()
    try:
        plan = forms.row_id(form, "plan_id")
        values = [forms.money(form, f) for f in ("prompt", "completion", "adapter_surcharge")]
        if any(v is None for v in values):
            raise forms.FormError("all three prices are needed (0 is a price)")
        price = Price(*values, currency=known_currency((forms.text(form, "currency") or "USD").upper()))
        period = forms.text(form, "period") or period_of(today_utc())
        with services.sessions() as session:
            set_plan_price(session, plan, price, period)
            session.commit()
    except (forms.FormError, ValueError, LookupError) as exc:
        sent, plan_sent = form.get("period"), form.get("plan_id")
        again = f"/console/billing?period={quote(sent)}" if isinstance(sent, str) and sent else "/console/billing"
        return redirect(request, again, error=f"Prices not saved: {exc}",
                        kept=(f"price-plan-{plan_sent if isinstance(plan_sent, str) else ''}", form))
    return redirect(request, f"/console/billing?period={period}", flash=f"Prices saved, in force from {period} on.")


@router.post("/billing/finalize")
async def billing_finalize(request: Request, _context: ConsolePostDep, services: ServicesDep) -> RedirectResponse:
    form = await request.form()
    try:
        period = forms.text(form, "period") or previous_period(today_utc())
    except forms.FormError as exc:
        return redirect(request, "/console/billing", error=str(exc))
    try:
        with services.sessions() as session:
            count = finalize_period(session, period)
            session.commit()
    except ValueError as exc:
        return redirect(request, f"/console/billing?period={quote(period)}", error=str(exc))
    return redirect(request, f"/console/billing?period={period}", flash=f"{count} statements for {period} are final.")


@router.get("/billing/statements/{tenant_id}/{period}")
def statement_page(request: Request, context: ConsoleDep, services: ServicesDep, tenant_id: IdPath, period: str):
    fmt = request.query_params.get("format")
    if fmt and fmt not in ("csv", "json"):
        return Response(f"format must be csv or json, got {fmt!r}\n", status_code=400,
                        media_type="text/plain; charset=utf-8")
    with services.sessions() as session:
        try:
            tenant = get_tenant(session, tenant_id)
            view = statement_of(session, tenant, period)
        except (TenantError, NoStatement, ValueError):
            return render(request, "not_found.html", context, status_code=404,
                          what=f"statement {period} of tenant {tenant_id}")
    if fmt in ("csv", "json"):
        return _private(statement_response(view, fmt, download=True))
    return render(request, "statement.html", context, s=view)
