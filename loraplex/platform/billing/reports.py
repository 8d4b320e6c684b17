"""Usage reports over a date range, grouped the way finance asks: by day, tenant, key and adapter.

Closed days come from the daily rollups; today, yesterday (late batched writes may still land) and any day
no rollup has covered are summed live from the usage records, so a report is never stale or incomplete.
Amounts use the prices in force for each day's month and are rounded as statements round them: per tenant,
month, adapter and component, then summed. A row that spans a whole month of a tenant is its statement's
amount, and rows split by adapter add up to the tenant's row; rows split by day round each day's tokens.
Statements are the authoritative bill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.billing.adapter_filter import AdapterFilter, parse_adapter_filter
from loraplex.platform.billing.aggregate import UsageTotals, adapter_label, aggregate_records
from loraplex.platform.billing.lines import BASE_MODEL, UsageGroup, build_lines, total_amount
from loraplex.platform.billing.models import BASE_ADAPTER, NO_KEY, UsageRollup
from loraplex.platform.billing.periods import day_range, days_in, period_of, today_utc
from loraplex.platform.billing.prices import price_for_tenant
from loraplex.platform.billing.pricing import Price
from loraplex.platform.billing.rollups import rolled_up_days
from loraplex.platform.models import ApiKey, Tenant

DIMENSIONS = ("day", "tenant", "key", "adapter")


def parse_group_by(text: str, allowed: tuple[str, ...] = DIMENSIONS) -> tuple[str, ...]:
    """"day,adapter" -> ("day", "adapter"): each name once, in the order given; ValueError naming any other."""
    dims = tuple(dict.fromkeys(d.strip() for d in text.split(",") if d.strip()))
    unknown = [d for d in dims if d not in allowed]
    if unknown:
        shown = [d if len(d) <= 40 else d[:40] + "..." for d in unknown[:5]]
        raise ValueError(f"cannot group by {shown}; choose from {list(allowed)}")
    return dims


@dataclass
class ReportRow:
    day: date | None
    tenant_id: int | None
    tenant: str | None
    api_key_id: int | None
    key: str | None
    adapter: str | None
    requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms_total: int = 0
    currency: str = ""
    # (tenant, month) -> (its price, adapter label -> [prompt, completion tokens]): what the amount rounds
    parts: dict = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def amount(self) -> int:
        """The row's amount; meaningful alone only when the row has one currency (see `amounts`)."""
        return sum(self.amounts.values())

    @property
    def amounts(self) -> dict[str, int]:
        """currency -> amount: a row over tenants or months priced in different currencies has several."""
        out: dict[str, int] = {}
        for price, by_adapter in self.parts.values():
            groups = [UsageGroup(label, 0, p, c) for label, (p, c) in by_adapter.items()]
            out[price.currency] = out.get(price.currency, 0) + total_amount(build_lines(groups, price))
        return out

    @property
    def avg_latency_ms(self) -> int | None:
        return self.latency_ms_total // self.requests if self.requests else None

    @classmethod
    def columns(cls, dims: Iterable[str]) -> list[str]:
        """The keys of `as_dict(dims)`, for a report with no rows."""
        return list(cls(None, None, None, None, None, None).as_dict(dims))

    def as_dict(self, dims: Iterable[str]) -> dict:
        dims = set(dims)
        out: dict = {}
        if "day" in dims:
            out["day"] = self.day.isoformat() if self.day else None
        if "tenant" in dims:
            out["tenant_id"], out["tenant"] = self.tenant_id, self.tenant
        if "key" in dims:
            out["api_key_id"], out["key"] = self.api_key_id, self.key
        if "adapter" in dims:
            out["adapter"] = self.adapter
        out.update(
            requests=self.requests, failed_requests=self.failed_requests, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, total_tokens=self.total_tokens,
            # a row over prices in different currencies has no one amount (group by tenant to split it)
            avg_latency_ms=self.avg_latency_ms, amount=None if self.currency == "mixed" else self.amount,
            currency=self.currency, amounts=dict(sorted(self.amounts.items())),
        )
        return out


def _daily_totals(
    session: Session, start: date, end: date, tenant_ids: list[int] | None
) -> list[tuple[date, UsageTotals]]:
    live_from = today_utc() - timedelta(days=1)
    closed = {d for d in rolled_up_days(session, start, end) if d < live_from}
    out: list[tuple[date, UsageTotals]] = []
    if closed:
        stmt = select(UsageRollup).where(UsageRollup.day.in_(sorted(closed)))
        if tenant_ids is not None:
            stmt = stmt.where(UsageRollup.tenant_id.in_(tenant_ids))
        for r in session.scalars(stmt):
            out.append((r.day, UsageTotals(
                r.tenant_id, r.api_key_id, r.adapter_name, r.adapter_version, r.requests, r.failed_requests,
                r.prompt_tokens, r.completion_tokens, r.latency_ms_total,
            )))
    for day in days_in(start, end):
        if day not in closed:
            lo, hi = day_range(day)
            out.extend((day, t) for t in aggregate_records(session, lo, hi, tenant_ids=tenant_ids))
    return out


def usage_report(
    session: Session,
    start: date,
    end: date,
    *,
    group_by: Iterable[str] = ("day",),
    tenant_ids: list[int] | None = None,
    api_key_id: int | None = None,
    adapter: str | AdapterFilter | None = None,
) -> list[ReportRow]:
    """Rows for [start, end] (inclusive, UTC days) grouped by `group_by` (a subset of DIMENSIONS).

    `adapter` filters by adapter: `name`, `name@version` or "" for the base model; `api_key_id` by key.
    """
    dims = tuple(dict.fromkeys(group_by))
    unknown = set(dims) - set(DIMENSIONS)
    if unknown:
        raise ValueError(f"cannot group by {sorted(unknown)}; choose from {list(DIMENSIONS)}")
    if isinstance(adapter, str):
        adapter = parse_adapter_filter(adapter)
    totals = _daily_totals(session, start, end, tenant_ids)
    if api_key_id is not None:
        totals = [(d, t) for d, t in totals if t.api_key_id == api_key_id]
    if adapter is not None:
        totals = [(d, t) for d, t in totals if adapter.matches(t.adapter_name, t.adapter_version)]
    tenant_rows = {t.tenant_id for _, t in totals}
    tenants = {t.id: t for t in session.scalars(select(Tenant).where(Tenant.id.in_(tenant_rows)))} if tenant_rows else {}
    prices: dict[tuple[int, str], Price] = {}

    def price_of(tenant_id: int, day: date) -> Price:
        key = (tenant_id, period_of(day))
        if key not in prices:
            prices[key] = price_for_tenant(session, tenants[tenant_id], key[1])
        return prices[key]

    key_ids = {t.api_key_id for _, t in totals if t.api_key_id != NO_KEY}
    keys = {}
    if "key" in dims and key_ids:
        keys = {k.id: f"{k.name} ({k.prefix}…)" for k in session.scalars(select(ApiKey).where(ApiKey.id.in_(key_ids)))}
    rows: dict[tuple, ReportRow] = {}
    for day, t in totals:
        label = adapter_label(t.adapter_name, t.adapter_version)
        group = (
            day if "day" in dims else None,
            t.tenant_id if "tenant" in dims else None,
            t.api_key_id if "key" in dims else None,
            label if "adapter" in dims else None,
        )
        row = rows.get(group)
        if row is None:
            tenant = tenants.get(t.tenant_id)
            row = rows[group] = ReportRow(
                day=group[0], tenant_id=group[1], tenant=tenant.name if tenant and "tenant" in dims else None,
                api_key_id=group[2],
                key=(keys.get(t.api_key_id, "console" if t.api_key_id == NO_KEY else f"key {t.api_key_id}")
                     if "key" in dims else None),
                adapter=group[3],
            )
        price = price_of(t.tenant_id, day)
        row.requests += t.requests
        row.failed_requests += t.failed_requests
        row.prompt_tokens += t.prompt_tokens
        row.completion_tokens += t.completion_tokens
        row.latency_ms_total += t.latency_ms_total
        _, by_adapter = row.parts.setdefault((t.tenant_id, period_of(day)), (price, {}))
        tokens = by_adapter.setdefault(label if t.adapter_name != BASE_ADAPTER else BASE_MODEL, [0, 0])
        tokens[0] += t.prompt_tokens
        tokens[1] += t.completion_tokens
        row.currency = price.currency if row.currency in ("", price.currency) else "mixed"
    return sorted(rows.values(), key=lambda r: (
        r.day or date.min, r.tenant or "", r.api_key_id or 0, r.adapter or "",
    ))
