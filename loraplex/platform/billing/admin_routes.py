"""/admin/api/billing: prices, cross-tenant reports, statements, rollups. Amounts in integer micro-units."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from sqlalchemy import select

from loraplex.platform.billing.export import statement_dict, statements_summary_csv
from loraplex.platform.billing.periods import Day, checked_period, days_in, parse_period, resolve_rollup_range
from loraplex.platform.billing.prices import (
    CurrencyConflict,
    price_lists,
    set_plan_price,
    set_tenant_override,
    tenant_override,
)
from loraplex.platform.billing.pricing import Price, PriceOverride, known_currency
from loraplex.platform.billing.reports import usage_report
from loraplex.platform.billing.responses import (
    AdapterQuery,
    EndQuery,
    FormatQuery,
    GroupByQuery,
    StartQuery,
    adapter_filter,
    date_range,
    dimensions,
    report_response,
    statement_response,
)
from loraplex.platform.billing.rollups import rollup_day
from loraplex.platform.billing.schemas import CSV_OR_JSON
from loraplex.platform.billing.statements import (
    NoStatement,
    finalize_period,
    get_statement,
    list_statements,
    statement_of,
    tenants_of_period,
)
from loraplex.platform.deps import AdminDep, IdPath, KnownQueryDep, RowId, SessionDep
from loraplex.platform.errors import bad_request, conflict, not_found
from loraplex.platform.models import Tenant
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.tenants import get_tenant

router = APIRouter(route_class=StrictJsonRoute, prefix="/admin/api/billing", tags=["admin billing"])
Micros = Annotated[int, Field(ge=0, le=10**15, description="micro-units of the currency per million tokens")]


# a YYYY-MM that names a month a statement can cover (year 0001-9998), refused by name otherwise
PeriodStr = Annotated[str, AfterValidator(checked_period)]


def _effective_period():
    return Field(default=None, pattern=r"^\d{4}-(0[1-9]|1[0-2])$",
                 description="first billing period (YYYY-MM) the prices apply to; default: the current one")


class PriceBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_price: Micros
    completion_price: Micros
    adapter_surcharge_price: Micros
    currency: Annotated[str, AfterValidator(known_currency)] = Field(default="USD", pattern=r"^[A-Z]{3}$")
    effective_period: PeriodStr | None = _effective_period()


class OverrideBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_price: Micros | None = None
    completion_price: Micros | None = None
    adapter_surcharge_price: Micros | None = None
    effective_period: PeriodStr | None = _effective_period()


class PeriodBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    period: PeriodStr = Field(pattern=r"^\d{4}-\d{2}$", examples=["2026-10"])


class RollupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start: Day
    end: Day | None = None


def _price_json(price: Price | None) -> dict | None:
    if price is None:
        return None
    return {"prompt_price": price.prompt, "completion_price": price.completion,
            "adapter_surcharge_price": price.adapter_surcharge, "currency": price.currency}


@router.get("/prices")
def get_prices(*, _admin: AdminDep, session: SessionDep,
               period: Annotated[str | None, Query(description="YYYY-MM (default: current)")] = None) -> JSONResponse:
    if period is not None:
        _check_period(period)
    return JSONResponse({"period": period, "data": [
        {"plan_id": p["plan_id"], "plan": p["plan"], "price": _price_json(p["price"]), "scheduled": p["scheduled"]}
        for p in price_lists(session, period)
    ]})


@router.put("/prices/default")
def put_default_price(*, _admin: AdminDep, session: SessionDep, body: PriceBody) -> JSONResponse:
    return _set_price(session, None, body)


@router.put("/prices/plans/{plan_id}")
def put_plan_price(*, _admin: AdminDep, session: SessionDep, plan_id: IdPath, body: PriceBody) -> JSONResponse:
    return _set_price(session, plan_id, body)


def _set_price(session, plan_id: int | None, body: PriceBody) -> JSONResponse:
    price = Price(body.prompt_price, body.completion_price, body.adapter_surcharge_price, body.currency)
    try:
        set_plan_price(session, plan_id, price, body.effective_period)
    except LookupError as exc:
        raise not_found(str(exc), param="plan_id") from exc
    except CurrencyConflict as exc:
        raise conflict(str(exc), param="currency") from exc
    except ValueError as exc:  # a month already billed
        raise conflict(str(exc), param="effective_period") from exc
    return JSONResponse({"plan_id": plan_id, "effective_period": body.effective_period, "price": _price_json(price)})


@router.get("/tenants/{tenant_id}/price-override")
def get_override(*, _admin: AdminDep, session: SessionDep, tenant_id: IdPath,
                 period: Annotated[str | None, Query()] = None) -> JSONResponse:
    if period is not None:
        _check_period(period)
    tenant = get_tenant(session, tenant_id)
    o = tenant_override(session, tenant.id, period) or PriceOverride()
    return JSONResponse({"tenant_id": tenant.id, "prompt_price": o.prompt, "completion_price": o.completion,
                         "adapter_surcharge_price": o.adapter_surcharge})


@router.put("/tenants/{tenant_id}/price-override")
def put_override(*, _admin: AdminDep, session: SessionDep, tenant_id: IdPath, body: OverrideBody) -> JSONResponse:
    tenant = get_tenant(session, tenant_id)
    try:
        set_tenant_override(session, tenant.id, PriceOverride(body.prompt_price, body.completion_price,
                                                              body.adapter_surcharge_price), body.effective_period)
    except CurrencyConflict as exc:
        raise conflict(str(exc), param="currency") from exc
    except ValueError as exc:  # a month already billed
        raise conflict(str(exc), param="effective_period") from exc
    return JSONResponse({"tenant_id": tenant.id, **body.model_dump()})


@router.get("/report", responses={200: CSV_OR_JSON})
def report(
    *, _admin: AdminDep, _known: KnownQueryDep, session: SessionDep, start: StartQuery = None, end: EndQuery = None,
    tenant_id: Annotated[list[RowId] | None, Query(description="repeat to select several tenants")] = None,
    group_by: GroupByQuery = "tenant", adapter: AdapterQuery = None,
    api_key_id: Annotated[RowId | None, Query()] = None, format: FormatQuery = "json",
) -> Response:
    start, end = date_range(start, end)
    dims = dimensions(group_by)
    if tenant_id:
        _tenants(session, tenant_id)  # unknown ids are a 404, not an empty report
    wanted = adapter_filter(session, adapter, tenant_id or None)
    rows = usage_report(session, start, end, group_by=dims, tenant_ids=tenant_id, adapter=wanted,
                        api_key_id=api_key_id)
    return report_response(rows, dims, start, end, format, "usage-all-tenants")


@router.get("/statements", responses={200: CSV_OR_JSON})
def statements(
    *, _admin: AdminDep, _known: KnownQueryDep, session: SessionDep, period: Annotated[str | None, Query()] = None,
    tenant_id: Annotated[list[RowId] | None, Query()] = None, format: FormatQuery = "json",
) -> Response:
    """Final statements; with `period`, the statement for it of every selected tenant that has one (a draft
    where not final; tenants created after the month have none)."""
    if period is not None:
        _check_period(period)
        _tenants(session, tenant_id)  # unknown ids are a 404
        views = [get_statement(session, t, period) for t in tenants_of_period(session, period, tenant_id)]
    else:
        names = {t.id: t for t in _tenants(session, tenant_id)}
        views = [get_statement(session, names[s.tenant_id], s.period)
                 for s in list_statements(session, tenant_ids=tenant_id) if s.tenant_id in names]
    if format == "csv":
        return Response(statements_summary_csv(views), media_type="text/csv; charset=utf-8",
                        headers={"content-disposition": f'attachment; filename="statements-{period or "all"}.csv"'})
    return JSONResponse({"object": "list", "data": [statement_dict(v) for v in views]})


@router.get("/statements/{tenant_id}/{period}", responses={200: CSV_OR_JSON})
def statement(*, _admin: AdminDep, _known: KnownQueryDep, session: SessionDep, tenant_id: IdPath, period: str,
              format: FormatQuery = "json") -> Response:
    _check_period(period)
    try:
        view = statement_of(session, get_tenant(session, tenant_id), period)
    except NoStatement as exc:
        raise not_found(str(exc), param="period") from exc
    return statement_response(view, format)


@router.post("/statements/finalize")
def finalize(*, _admin: AdminDep, session: SessionDep, body: PeriodBody) -> JSONResponse:
    try:
        count = finalize_period(session, body.period)
    except ValueError as exc:
        raise bad_request(str(exc), param="period") from exc
    return JSONResponse({"period": body.period, "statements": count})


@router.post("/rollups")
def run_rollups(*, _admin: AdminDep, session: SessionDep, body: RollupBody) -> JSONResponse:
    try:
        start, end = resolve_rollup_range(body.start, body.end)
    except ValueError as exc:
        raise bad_request(str(exc), param="start") from exc
    rows = {d.isoformat(): rollup_day(session, d) for d in days_in(start, end)}
    return JSONResponse({"days": rows})


def _check_period(period: str) -> None:
    try:
        parse_period(period)
    except ValueError as exc:
        raise bad_request(str(exc), param="period") from exc


def _tenants(session, tenant_ids: list[int] | None) -> list[Tenant]:
    """The tenants named (all without `tenant_ids`), by name; a 404 naming any id that is no tenant's."""
    stmt = select(Tenant).order_by(Tenant.name)
    if tenant_ids:
        stmt = stmt.where(Tenant.id.in_(tenant_ids))
    found = list(session.scalars(stmt))
    unknown = sorted(set(tenant_ids or ()) - {t.id for t in found})
    if unknown:
        raise not_found(f"no tenant with id {', '.join(map(str, unknown[:10]))}", param="tenant_id")
    return found
