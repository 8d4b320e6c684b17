"""The caller's usage by day and adapter version, straight from the usage records."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import case, func
from sqlalchemy.orm import Session

from loraplex.platform.billing.adapter_filter import AdapterFilter
from loraplex.platform.billing.aggregate import FAILED_STATUSES
from loraplex.platform.billing.models import BASE_ADAPTER
from loraplex.platform.models import UsageRecord
from loraplex.platform.schemas.usage import UsageBucket
from loraplex.platform.scoping import TenantScope
from loraplex.platform.usage.inflight import INTERRUPTED


def _day(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        return func.date(func.timezone("UTC", UsageRecord.created_at))
    return func.date(UsageRecord.created_at)


def _adapter_conditions(adapter: AdapterFilter | None) -> list:
    if adapter is None:
        return []
    if adapter.name == BASE_ADAPTER:
        return [UsageRecord.adapter_name.is_(None)]
    conditions = [UsageRecord.adapter_name == adapter.name]
    if adapter.version is not None:
        conditions.append(UsageRecord.adapter_version.startswith(adapter.version, autoescape=True))
    return conditions


def usage_by_day(session: Session, tenant_id: int, start: date, end: date, *,
                 adapter: AdapterFilter | None = None, api_key_id: int | None = None) -> list[UsageBucket]:
    """Inclusive date range, UTC days; optionally only one adapter (`name`, `name@version`, or the base model)
    or one API key. Tokens are counted as billed: a request that failed on the server's side counts as a
    (failed) request, its tokens do not."""
    lo = datetime.combine(start, time.min, tzinfo=UTC)
    hi = datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC)
    day = _day(session).label("day")
    failed_row = UsageRecord.status.in_(FAILED_STATUSES)
    failed = func.sum(case((failed_row, 1), else_=0))
    interrupted = func.sum(case((UsageRecord.status == INTERRUPTED, 1), else_=0))
    stmt = (
        TenantScope(session, tenant_id)
        .select(UsageRecord, UsageRecord.created_at >= lo, UsageRecord.created_at < hi)
        .with_only_columns(day, UsageRecord.adapter_name, UsageRecord.adapter_version, func.count(), failed,
                           interrupted,
                           func.sum(case((failed_row, 0), else_=UsageRecord.prompt_tokens)),
                           func.sum(case((failed_row, 0), else_=UsageRecord.completion_tokens)))
        .where(*_adapter_conditions(adapter),
               *([UsageRecord.api_key_id == api_key_id] if api_key_id is not None else []))
        .group_by(day, UsageRecord.adapter_name, UsageRecord.adapter_version)
        .order_by(day, UsageRecord.adapter_name, UsageRecord.adapter_version)
    )
    out = []
    for d, name, version, count, failures, cut, prompt, completion in session.execute(stmt):
        d = d if isinstance(d, date) else date.fromisoformat(d)
        # the version as users type it after "@" (12 hex digits), as everywhere else in the API
        out.append(UsageBucket(date=d, adapter=name, adapter_version=version[:12] if version else None,
                               requests=count, failed_requests=int(failures or 0),
                               interrupted_requests=int(cut or 0), prompt_tokens=prompt or 0,
                               completion_tokens=completion or 0, total_tokens=(prompt or 0) + (completion or 0)))
    return out
