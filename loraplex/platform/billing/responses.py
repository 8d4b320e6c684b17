"""Report and statement responses in JSON or CSV, with the query parameters finance filters by."""

from __future__ import annotations

from datetime import date
from typing import Annotated, Literal

from fastapi import Query
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session

from loraplex.platform.billing.adapter_filter import (
    AdapterFilter,
    UnknownAdapter,
    check_known,
    parse_adapter_filter,
)
from loraplex.platform.billing.export import rows_to_csv, statement_csv, statement_dict, with_decimal_amounts
from loraplex.platform.billing.periods import Day, resolve_range
from loraplex.platform.billing.reports import DIMENSIONS, ReportRow, parse_group_by
from loraplex.platform.billing.schemas import ReportRowPublic, StatementPublic, UsageReportPublic
from loraplex.platform.billing.statements import StatementView
from loraplex.platform.errors import bad_request, not_found

Format = Literal["json", "csv"]
StartQuery = Annotated[Day | None, Query(description="first UTC day, YYYY-MM-DD, inclusive (default: first of this month)")]
EndQuery = Annotated[Day | None, Query(description="last UTC day, YYYY-MM-DD, inclusive (default: today)")]
GroupByQuery = Annotated[str, Query(description=f"comma-separated subset of {', '.join(DIMENSIONS)}")]
AdapterQuery = Annotated[str | None, Query(
    description="only this adapter: its name, name@version, or empty for the base model alone")]
FormatQuery = Annotated[Format, Query(description="json or csv")]


def date_range(start: date | None, end: date | None) -> tuple[date, date]:
    try:
        return resolve_range(start, end)
    except ValueError as exc:
        raise bad_request(str(exc), param="start") from exc


def dimensions(group_by: str, allowed: tuple[str, ...] = DIMENSIONS) -> tuple[str, ...]:
    try:
        return parse_group_by(group_by, allowed)
    except ValueError as exc:
        raise bad_request(str(exc), param="group_by") from exc


def adapter_filter(session: Session, adapter: str | None, tenant_ids: list[int] | None, *,
                   own: bool = False) -> AdapterFilter | None:
    """The report's `adapter` filter, or a 400 (malformed) or 404 (naming no adapter of theirs) that says so;
    `own` for a tenant's report of its own usage."""
    if adapter is None:
        return None
    try:
        wanted = parse_adapter_filter(adapter)
        check_known(session, wanted, tenant_ids, own=own)
    except UnknownAdapter as exc:
        raise not_found(str(exc), param="adapter", code="adapter_not_found") from exc
    except ValueError as exc:
        raise bad_request(f"Invalid value for 'adapter': {exc}", param="adapter") from exc
    return wanted


def _attachment(filename: str) -> dict[str, str]:
    return {"content-disposition": f'attachment; filename="{filename}"'}


def report_response(
    rows: list[ReportRow], dims: tuple[str, ...], start: date, end: date, fmt: Format, filename: str,
    *, download: bool = False,
) -> Response:
    """The report as CSV (always a file to save) or JSON; `download` makes the JSON a file too, for a link a
    person clicks (the console's "Export JSON") rather than a response a program reads."""
    data = [r.as_dict(dims) for r in rows]
    if fmt == "csv":
        return Response(rows_to_csv(data, ReportRow.columns(dims)), media_type="text/csv; charset=utf-8",
                        headers=_attachment(f"{filename}-{start}-{end}.csv"))
    amounts: dict[str, int] = {}
    for r in rows:
        for currency, amount in r.amounts.items():
            amounts[currency] = amounts.get(currency, 0) + amount
    totals = with_decimal_amounts({
        "requests": sum(r.requests for r in rows),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "completion_tokens": sum(r.completion_tokens for r in rows),
        "amounts": dict(sorted(amounts.items())),
    })
    body = UsageReportPublic(
        start=start.isoformat(), end=end.isoformat(), group_by=list(dims), totals=totals,
        data=[with_decimal_amounts(d) for d in data],
        note="amounts are estimates at each month's prices, rounded once per row; statements are the bill",
    ).model_dump(mode="json")
    # rows carry only the dimensions they were grouped by
    body["data"] = [row.model_dump(mode="json", exclude_unset=True) for row in
                    (ReportRowPublic.model_validate(with_decimal_amounts(d)) for d in data)]
    return JSONResponse(body, headers=_attachment(f"{filename}-{start}-{end}.json") if download else None)


def statement_response(view: StatementView, fmt: Format, *, download: bool = False) -> Response:
    """The statement as CSV (always a file to save) or JSON; `download` makes the JSON a file too."""
    name = f"statement-{view.tenant}-{view.period}"
    if fmt == "csv":
        return Response(statement_csv(view), media_type="text/csv; charset=utf-8", headers=_attachment(f"{name}.csv"))
    return JSONResponse(StatementPublic.model_validate(statement_dict(view)).model_dump(mode="json"),
                        headers=_attachment(f"{name}.json") if download else None)
