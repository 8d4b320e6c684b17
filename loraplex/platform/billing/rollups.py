"""Daily rollups: re-running a day deletes and rebuilds that day's rows in one transaction."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from loraplex.platform.billing.aggregate import aggregate_records
from loraplex.platform.billing.locks import ROLLUP_DAY, serialize
from loraplex.platform.billing.models import RollupRun, UsageRollup
from loraplex.platform.billing.periods import day_range
from loraplex.platform.models import utcnow


def rollup_day(session: Session, day: date) -> int:
    """Rebuild the rollup rows of `day` (UTC) from its usage records; returns the number of rows.

    The caller commits; the delete and the inserts land together, so a reader never sees half a day.
    """
    serialize(session, ROLLUP_DAY, day.toordinal())
    start, end = day_range(day)
    totals = aggregate_records(session, start, end)
    session.execute(delete(UsageRollup).where(UsageRollup.day == day))
    session.add_all(
        UsageRollup(
            day=day, tenant_id=t.tenant_id, api_key_id=t.api_key_id, adapter_name=t.adapter_name,
            adapter_version=t.adapter_version, requests=t.requests, failed_requests=t.failed_requests,
            prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
            latency_ms_total=t.latency_ms_total,
        )
        for t in totals
    )
    run = session.get(RollupRun, day)
    records = sum(t.requests for t in totals)
    if run is None:
        session.add(RollupRun(day=day, records=records, rolled_at=utcnow()))
    else:
        run.records = records
        run.rolled_at = utcnow()
    session.flush()
    return len(totals)


# Usage records reach the database in batches a few seconds behind their requests: a rollup made this long
# after its day ended holds the whole day.
LATE_WRITES = timedelta(hours=1)


def rolled_up_days(session: Session, start: date, end: date) -> set[date]:
    """The days in [start, end] whose rollup is final: made after the day was over (and its late writes
    had landed). A rollup made while its day still ran (the hourly task rolls today up too) holds only its
    first hours; if no later one replaced it (a server stopped that afternoon, a worker down the next day),
    reports must not take it for the day's total."""
    rows = session.execute(select(RollupRun.day, RollupRun.rolled_at)
                           .where(RollupRun.day >= start, RollupRun.day <= end))
    return {day for day, rolled_at in rows if _aware(rolled_at) >= day_range(day)[1] + LATE_WRITES}


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
