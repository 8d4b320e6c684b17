"""GET /v1/usage: the caller's own usage by day and adapter."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from fastapi import APIRouter, Query

from loraplex.platform.deps import SessionDep, UsageKeyDep
from loraplex.platform.errors import bad_request
from loraplex.platform.schemas.usage import UsageReport
from loraplex.platform.usage.report import usage_by_day

router = APIRouter(prefix="/v1", tags=["usage"])
MAX_DAYS = 366


@router.get("/usage", response_model=UsageReport)
def read_usage(*, tenant: UsageKeyDep, session: SessionDep,
               start: date | None = Query(default=None, description="first UTC day (default: 30 days ago)"),
               end: date | None = Query(default=None, description="last UTC day, inclusive (default: today)"),
               ) -> UsageReport:
    end = end or datetime.now(UTC).date()
    start = start or end - timedelta(days=29)
    if start > end:
        raise bad_request("start must not be after end", param="start")
    if (end - start).days >= MAX_DAYS:
        raise bad_request(f"the range may span at most {MAX_DAYS} days", param="start")
    return UsageReport(start=start, end=end, data=usage_by_day(session, tenant.tenant_id, start, end))
