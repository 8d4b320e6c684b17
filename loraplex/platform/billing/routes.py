"""Tenant-facing billing: the caller's usage report and monthly statements, scoped by its API key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from loraplex.platform.billing.export import statement_dict
from loraplex.platform.billing.periods import parse_period, period_of, previous_period, today_utc
from loraplex.platform.billing.reports import usage_report
from loraplex.platform.billing.responses import (
    AdapterQuery,
    EndQuery,
    FormatQuery,
    StartQuery,
    adapter_filter,
    date_range,
    dimensions,
    report_response,
    statement_response,
)
from loraplex.platform.billing.schemas import (
    CSV_OR_JSON,
    StatementList,
    StatementPublic,
    StatementSummary,
    UsageReportPublic,
)
from loraplex.platform.billing.statements import (
    NoStatement,
    get_statement,
    list_statements,
    statement_of,
    tenants_of_period,
)
from loraplex.platform.deps import KnownQueryDep, RowId, SessionDep, UsageKeyDep
from loraplex.platform.errors import bad_request, not_found
from loraplex.platform.models import Tenant
from loraplex.platform.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute, prefix="/v1", tags=["billing"])
TENANT_DIMENSIONS = ("day", "key", "adapter")
# a tenant's report covers that tenant alone: it has no `tenant` dimension
TenantGroupByQuery = Annotated[str, Query(description=f"comma-separated subset of {', '.join(TENANT_DIMENSIONS)}")]


def tenant_usage(
    session, tenant_id: int, *, start, end, group_by: str, adapter: str | None, api_key_id: int | None, fmt
) -> Response:
    """One tenant's usage, filtered and grouped (there is no tenant dimension to group by)."""
    start, end = date_range(start, end)
    dims = dimensions(group_by, TENANT_DIMENSIONS)
    wanted = adapter_filter(session, adapter, [tenant_id], own=True)
    rows = usage_report(session, start, end, group_by=dims, tenant_ids=[tenant_id],
                        adapter=wanted, api_key_id=api_key_id)
    return report_response(rows, dims, start, end, fmt, "usage")


@router.get("/usage/report", response_model=None,
            responses={200: {"model": UsageReportPublic, **CSV_OR_JSON}})
def usage_report_route(
    *, caller: UsageKeyDep, _known: KnownQueryDep, session: SessionDep, start: StartQuery = None, end: EndQuery = None,
    group_by: TenantGroupByQuery = "day,adapter", adapter: AdapterQuery = None,
    api_key_id: Annotated[RowId | None, Query()] = None, format: FormatQuery = "json",
) -> Response:
    return tenant_usage(session, caller.tenant_id, start=start, end=end, group_by=group_by, adapter=adapter,
                        api_key_id=api_key_id, fmt=format)


@router.get("/billing/statements", response_model=StatementList)
def statements(*, caller: UsageKeyDep, _known: KnownQueryDep, session: SessionDep,
               period: Annotated[str | None, Query(description="only this month's statement, YYYY-MM")] = None,
               ) -> StatementList:
    """Final statements, newest first, with drafts for this month and last month while they are not final.
    With `period` (as the admin list takes it), the statement of that month alone: final, or a draft where
    not final; none for a month that has not begun or one before the tenant."""
    if period is not None:
        try:
            parse_period(period)
        except ValueError as exc:
            raise bad_request(str(exc), param="period") from exc
    tenant = session.get(Tenant, caller.tenant_id)
    today = today_utc()
    final = {r.period for r in list_statements(session, tenant_ids=[caller.tenant_id])}
    # a month before the tenant existed (and had no usage) has no statement, as the admin views say
    candidates = (period_of(today), previous_period(today)) if period is None else (period,)
    drafts = [p for p in candidates if p not in final and tenants_of_period(session, p, [caller.tenant_id])]
    shown = set(drafts) | (final if period is None else final & {period})
    data = [statement_dict(get_statement(session, tenant, p)) for p in sorted(shown, reverse=True)]
    return StatementList(data=[StatementSummary.model_validate(item) for item in data])


@router.get("/billing/statements/{period}", response_model=None,
            responses={200: {"model": StatementPublic, **CSV_OR_JSON}})
def statement(*, caller: UsageKeyDep, _known: KnownQueryDep, session: SessionDep, period: str,
              format: FormatQuery = "json") -> Response:
    try:
        view = statement_of(session, session.get(Tenant, caller.tenant_id), period)
    except NoStatement as exc:
        raise not_found(str(exc), param="period") from exc
    except ValueError as exc:
        raise bad_request(str(exc), param="period") from exc
    return statement_response(view, format)


