"""Monthly statements: the tenant's usage records of a UTC month, priced, one rounding per line.

A statement of a month still open (or not yet finalized) is computed live and never stored; finalizing a
closed month stores it with its lines and unit prices, and it never changes afterwards. Prices are those in
force for the statement's own month (see prices.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from loraplex.platform.billing.aggregate import adapter_label, aggregate_records
from loraplex.platform.billing.lines import Line, UsageGroup, build_lines, total_amount
from loraplex.platform.billing.locks import STATEMENT_TENANT, serialize
from loraplex.platform.billing.models import Statement, StatementLine
from loraplex.platform.billing.periods import day_start, parse_period, period_bounds, period_of, today_utc
from loraplex.platform.billing.prices import price_for_tenant
from loraplex.platform.models import Tenant, UsageRecord, utcnow

# usage records are flushed in batches; a month is final only once late writes can no longer arrive
FINALIZE_GRACE = timedelta(hours=1)


@dataclass
class StatementView:
    tenant_id: int
    tenant: str
    period: str
    status: str  # draft | final
    currency: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_amount: int
    lines: list[Line] = field(default_factory=list)
    generated_at: datetime | None = None


def compute_statement(session: Session, tenant: Tenant, period: str) -> StatementView:
    first, nxt = period_bounds(period)
    totals = aggregate_records(session, day_start(first), day_start(nxt), tenant_ids=[tenant.id], by_key=False)
    price = price_for_tenant(session, tenant, period)
    groups = [
        UsageGroup(adapter_label(t.adapter_name, t.adapter_version), t.requests, t.prompt_tokens, t.completion_tokens)
        for t in totals
    ]
    lines = build_lines(groups, price)
    return StatementView(
        tenant_id=tenant.id, tenant=tenant.name, period=period, status="draft", currency=price.currency,
        requests=sum(t.requests for t in totals), prompt_tokens=sum(t.prompt_tokens for t in totals),
        completion_tokens=sum(t.completion_tokens for t in totals), total_amount=total_amount(lines),
        lines=lines, generated_at=utcnow(),
    )


def _view(row: Statement, tenant_name: str) -> StatementView:
    return StatementView(
        tenant_id=row.tenant_id, tenant=tenant_name, period=row.period, status=row.status, currency=row.currency,
        requests=row.requests, prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
        total_amount=row.total_amount,
        lines=[Line(x.adapter, x.component, x.tokens, x.unit_price, x.amount) for x in row.lines],
        generated_at=row.generated_at,
    )


def is_closed(period: str, now: datetime | None = None) -> bool:
    _, nxt = period_bounds(period)
    return (now or datetime.now(UTC)) >= day_start(nxt) + FINALIZE_GRACE


def get_statement(session: Session, tenant: Tenant, period: str) -> StatementView:
    """The final statement when there is one, else a live draft."""
    row = session.scalars(
        select(Statement).where(Statement.tenant_id == tenant.id, Statement.period == period)
    ).first()
    return _view(row, tenant.name) if row is not None else compute_statement(session, tenant, period)


class NoStatement(LookupError):
    """There is no statement of that tenant for that month (the month has not begun, or the tenant did not
    exist in it and had no usage)."""


def statement_of(session: Session, tenant: Tenant, period: str) -> StatementView:
    """`tenant`'s statement for `period` as every view shows it: final if finalized, else a live draft.
    ValueError for a malformed period; NoStatement for a month that has not begun or one before the tenant."""
    parse_period(period)
    if period > period_of(today_utc()):
        raise NoStatement(f"there is no statement for {period}: the month has not begun")
    if not tenants_of_period(session, period, [tenant.id]):
        raise NoStatement(f"there is no statement for {period}: tenant {tenant.name} did not exist then")
    return get_statement(session, tenant, period)


def finalize_statement(session: Session, tenant: Tenant, period: str, *, now: datetime | None = None) -> StatementView:
    """Store the statement of a closed month; idempotent (an existing final statement is returned as is)."""
    if not is_closed(period, now):
        raise ValueError(f"period {period} is not closed yet; statements are final only after the month ends")
    serialize(session, STATEMENT_TENANT, tenant.id)  # one finalizer per tenant at a time, whatever the period
    existing = session.scalars(
        select(Statement).where(Statement.tenant_id == tenant.id, Statement.period == period)
    ).first()
    if existing is not None:
        return _view(existing, tenant.name)
    view = compute_statement(session, tenant, period)
    row = Statement(
        tenant_id=tenant.id, period=period, status="final", currency=view.currency, requests=view.requests,
        prompt_tokens=view.prompt_tokens, completion_tokens=view.completion_tokens,
        total_amount=view.total_amount, generated_at=view.generated_at,
        lines=[
            StatementLine(position=i, adapter=x.adapter, component=x.component, tokens=x.tokens,
                          unit_price=x.unit_price, amount=x.amount)
            for i, x in enumerate(view.lines)
        ],
    )
    session.add(row)
    session.flush()
    view.status = "final"
    return view


def finalize_period(session: Session, period: str, *, now: datetime | None = None) -> int:
    """Finalize `period` for every tenant that existed in it or has usage in it (tenants created later get no
    empty statement for a month before their time); returns how many statements it has afterwards."""
    if not is_closed(period, now):  # refused whether or not any tenant existed in it
        raise ValueError(f"period {period} is not closed yet; statements are final only after the month ends")
    tenants = tenants_of_period(session, period)
    for tenant in tenants:
        finalize_statement(session, tenant, period, now=now)
    return len(tenants)


def tenants_of_period(session: Session, period: str, tenant_ids: list[int] | None = None) -> list[Tenant]:
    """The tenants that have a statement for `period`: those that existed in it or have usage in it (a
    tenant created later gets none; nobody has one for a month that has not begun), by id; optionally only
    some."""
    if period > period_of(today_utc()):
        return []
    first, nxt = period_bounds(period)
    used = select(UsageRecord.tenant_id).where(
        UsageRecord.created_at >= day_start(first), UsageRecord.created_at < day_start(nxt))
    stmt = select(Tenant).where(or_(Tenant.created_at < day_start(nxt), Tenant.id.in_(used))).order_by(Tenant.id)
    if tenant_ids is not None:
        stmt = stmt.where(Tenant.id.in_(tenant_ids))
    return list(session.scalars(stmt))


def list_statements(
    session: Session, *, tenant_ids: list[int] | None = None, period: str | None = None
) -> list[Statement]:
    stmt = select(Statement).order_by(Statement.period.desc(), Statement.tenant_id)
    if tenant_ids is not None:
        stmt = stmt.where(Statement.tenant_id.in_(tenant_ids))
    if period is not None:
        stmt = stmt.where(Statement.period == period)
    return list(session.scalars(stmt))
