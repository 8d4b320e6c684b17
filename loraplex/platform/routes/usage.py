"""GET /v1/usage: the caller's own usage by day and adapter."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from loraplex.platform.billing.periods import Day
from loraplex.platform.billing.responses import AdapterQuery, adapter_filter
from loraplex.platform.deps import KnownQueryDep, RowId, SessionDep, UsageKeyDep
from loraplex.platform.errors import bad_request
from loraplex.platform.schemas.usage import UsageBucket, UsageReport
from loraplex.platform.strict_json import StrictJsonRoute
from loraplex.platform.usage.report import usage_by_day

router = APIRouter(route_class=StrictJsonRoute, prefix="/v1", tags=["usage"])
MAX_DAYS = 366


@router.get("/usage", response_model=UsageReport, responses={200: {"content": {"text/csv": {}}}})
def read_usage(*, tenant: UsageKeyDep, _known: KnownQueryDep, session: SessionDep,
               start: Day | None = Query(default=None, description="first UTC day, YYYY-MM-DD (default: 30 days ago)"),
               end: Day | None = Query(default=None,
                                       description="last UTC day, YYYY-MM-DD, inclusive (default: today)"),
               adapter: AdapterQuery = None,
               api_key_id: RowId | None = Query(default=None, description="only requests made with this key"),
               format: Literal["json", "csv"] = Query(default="json"),
               ) -> UsageReport | Response:
    end = end or datetime.now(UTC).date()
    start = start or end - timedelta(days=29)
    if end >= date.max - timedelta(days=1):
        raise bad_request("end is out of range", param="end")
    if start > end:
        raise bad_request(f"start {start} is after end {end}: start must not be after end", param="start")
    if (end - start).days >= MAX_DAYS:
        raise bad_request(f"the range may span at most {MAX_DAYS} days", param="start")
    wanted = adapter_filter(session, adapter, [tenant.tenant_id], own=True)
    data = usage_by_day(session, tenant.tenant_id, start, end, adapter=wanted, api_key_id=api_key_id)
    if format == "csv":
        from loraplex.platform.billing.export import rows_to_csv

        return Response(rows_to_csv((b.model_dump(mode="json") for b in data), list(UsageBucket.model_fields)),
                        media_type="text/csv; charset=utf-8",
                        headers={"content-disposition": f'attachment; filename="usage-{start}-{end}.csv"'})
    return UsageReport(start=start, end=end, data=data)
