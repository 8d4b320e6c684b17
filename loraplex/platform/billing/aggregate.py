"""Summing usage records: the one query behind rollups, live reports and statements."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from loraplex.platform.billing.models import BASE_ADAPTER, NO_KEY
from loraplex.platform.models import UsageRecord

# Requests that failed on the server's side (the engine lost, an adapter that would not load): counted as
# requests and as failed, but their tokens are neither counted nor billed; the client got no answer, or an
# answer cut short by the server.
FAILED_STATUSES = ("error",)


@dataclass(frozen=True)
class UsageTotals:
    tenant_id: int
    api_key_id: int
    adapter_name: str
    adapter_version: str
    requests: int
    failed_requests: int
    prompt_tokens: int
    completion_tokens: int
    latency_ms_total: int


def aggregate_records(
    session: Session,
    start: datetime,
    end: datetime,
    *,
    tenant_ids: list[int] | None = None,
    by_key: bool = True,
) -> list[UsageTotals]:
    """Totals of records created in [start, end) per tenant, (key,) adapter name and version."""
    r = UsageRecord
    key_col = func.coalesce(r.api_key_id, NO_KEY) if by_key else None
    name_col = func.coalesce(r.adapter_name, BASE_ADAPTER)
    version_col = func.coalesce(r.adapter_version, BASE_ADAPTER)
    group = [r.tenant_id, name_col, version_col] + ([key_col] if by_key else [])
    stmt = (
        select(
            *group,
            func.count(r.id),
            func.sum(case((r.status.in_(FAILED_STATUSES), 1), else_=0)),
            func.sum(case((r.status.in_(FAILED_STATUSES), 0), else_=r.prompt_tokens)),
            func.sum(case((r.status.in_(FAILED_STATUSES), 0), else_=r.completion_tokens)),
            func.sum(r.latency_ms),
        )
        .where(r.created_at >= start, r.created_at < end)
        .group_by(*group)
    )
    if tenant_ids is not None:
        stmt = stmt.where(r.tenant_id.in_(tenant_ids))
    out = []
    for row in session.execute(stmt):
        tenant_id, name, version = row[0], row[1], row[2]
        key_id = row[3] if by_key else NO_KEY
        rest = row[4:] if by_key else row[3:]
        out.append(UsageTotals(tenant_id, int(key_id), name, version, *(int(v or 0) for v in rest)))
    out.sort(key=lambda t: (t.tenant_id, t.api_key_id, t.adapter_name, t.adapter_version))
    return out


def adapter_label(name: str, version: str) -> str:
    """"name@0123456789ab" (12 hex digits, as users type it), or "" for the base model."""
    if not name:
        return BASE_ADAPTER
    return f"{name}@{version[:12]}" if version else name
