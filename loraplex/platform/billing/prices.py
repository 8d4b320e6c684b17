"""Price lists and tenant overrides, each in force from a billing period (YYYY-MM) on.

A change names the first period it applies to (by default the current one, so the open month's draft
reflects it at once); months already billed keep the prices they were billed with, because a statement
looks up the rows in force for its own period.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.platform.billing.models import ALWAYS, PlanPrice, Statement, TenantPlan, TenantPrice
from loraplex.platform.billing.periods import next_period, parse_period, period_of, today_utc
from loraplex.platform.billing.pricing import FREE, Price, PriceOverride, effective_price
from loraplex.platform.models import Plan, Tenant


def _period(period: str | None) -> str:
    period = period or period_of(today_utc())
    parse_period(period)
    return period


def _refuse_billed_periods(session: Session, period: str, tenant_id: int | None = None) -> None:
    """A price change applies from `period` on: not to a month already billed (a final statement), whose
    reports would then disagree with its statement. Plan prices reach every tenant, an override one."""
    stmt = select(func.max(Statement.period))
    if tenant_id is not None:
        stmt = stmt.where(Statement.tenant_id == tenant_id)
    last = session.scalar(stmt)
    if last is not None and period <= last:
        raise ValueError(f"statements for {last} are final; a price change may apply from {next_period(last)} on, "
                         f"not from {period}")


def _plan_cond(plan_id: int | None):
    return PlanPrice.plan_id.is_(None) if plan_id is None else PlanPrice.plan_id == plan_id


class CurrencyConflict(ValueError):
    """A change that would put a tenant's price override, whose amounts were set in one currency, under a
    price list in another: the same numbers would then bill in the other currency."""


def _base_currency(session: Session, tenant: Tenant, period: str) -> str:
    """The currency `tenant` is billed in in `period` (its overrides carry none of their own)."""
    plan_id = plan_of(session, tenant, period)
    base = plan_price(session, plan_id, period) if plan_id is not None else None
    return (base or plan_price(session, None, period) or FREE).currency


def _change_points(session: Session, tenant_id: int, after: str) -> set[str]:
    """The months after `after` at which the currency a tenant is billed in could change: a price list (any
    plan's: the tenant's plan may change too) or a plan change of its own takes effect."""
    prices = session.scalars(select(PlanPrice.effective_period).where(PlanPrice.effective_period > after))
    plans = session.scalars(select(TenantPlan.effective_period).where(TenantPlan.tenant_id == tenant_id,
                                                                      TenantPlan.effective_period > after))
    return set(prices) | set(plans)


def _override_rows(session: Session, tenant_ids: list[int] | None) -> dict[int, list[tuple[TenantPrice, str, str | None]]]:
    """Per tenant, its overrides in force now or scheduled, each with the month from which it applies (now
    for one in force already) and, by the next row's start, the months it covers."""
    now = _period(None)
    stmt = select(TenantPrice).order_by(TenantPrice.tenant_id, TenantPrice.effective_period)
    if tenant_ids is not None:
        stmt = stmt.where(TenantPrice.tenant_id.in_(tenant_ids))
    rows_by_tenant: dict[int, list[TenantPrice]] = {}
    for row in session.scalars(stmt):
        rows_by_tenant.setdefault(row.tenant_id, []).append(row)
    out: dict[int, list[tuple[TenantPrice, str, str | None]]] = {}
    for tenant_id, rows in rows_by_tenant.items():
        for i, row in enumerate(rows):
            end = rows[i + 1].effective_period if i + 1 < len(rows) else None
            start = max(row.effective_period, now)
            empty = row.prompt_price is None and row.completion_price is None and row.adapter_surcharge_price is None
            if not empty and (end is None or end > start):
                out.setdefault(tenant_id, []).append((row, start, end))
    return out


def _override_currencies(session: Session, tenant_ids: list[int] | None = None) -> dict[tuple[int, str], str]:
    """(tenant id, override month) -> the currency its amounts are in: the tenant's billing currency in the
    month it applies from (now, for one in force already). Taken before a change, it is what the change must
    not move."""
    return {(tid, row.effective_period): _base_currency(session, session.get(Tenant, tid), start)
            for tid, rows in _override_rows(session, tenant_ids).items() for row, start, _end in rows}


def _currency_breaks(session: Session, set_in: dict[tuple[int, str], str],
                     tenant_ids: list[int] | None = None) -> dict[int, tuple[str, str, str]]:
    """Tenants with an override (in force now or scheduled) that would bill in another currency than its
    amounts are in (`set_in`, else its start month's) in some month it covers: tenant id -> (the currency
    of its amounts, the other one, from which month)."""
    now = _period(None)
    out = {}
    for tid, rows in _override_rows(session, tenant_ids).items():
        tenant = session.get(Tenant, tid)
        points = _change_points(session, tid, now)
        for row, start, end in rows:
            currency = set_in.get((tid, row.effective_period)) or _base_currency(session, tenant, start)
            for p in [start, *sorted(x for x in points if x > start and (end is None or x < end))]:
                other = _base_currency(session, tenant, p)
                if other != currency:
                    out[tid] = (currency, other, p)
                    break
            if tid in out:
                break
    return out


class _CurrencyGuard:
    """Taken before a price, plan or override change and checked after it (flushed, not committed): the
    change is refused when it makes an override bill in another currency than its amounts are in. An
    override that did so already (from before these checks) is left as it is: this change is not what did it."""

    def __init__(self, session: Session, tenant_ids: list[int] | None = None):
        self.session, self.tenant_ids = session, tenant_ids
        self.set_in = _override_currencies(session, tenant_ids)
        self.before = _currency_breaks(session, self.set_in, tenant_ids)

    def check(self, what: str) -> None:
        after = _currency_breaks(self.session, self.set_in, self.tenant_ids)
        new = {t: b for t, b in after.items() if t not in self.before}
        if not new:
            return
        names = sorted(self.session.get(Tenant, t).name for t in new)
        set_in, other, period = next(iter(new.values()))
        whose = f"tenant {names[0]}" if len(names) == 1 else \
            f"tenants {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"
        raise CurrencyConflict(
            f"{what} would bill the price overrides of {whose}, set in {set_in}, in {other} from {period}; change "
            "or clear those overrides first, or keep the currency")


def plan_price(session: Session, plan_id: int | None, period: str | None = None) -> Price | None:
    row = session.scalars(
        select(PlanPrice).where(_plan_cond(plan_id), PlanPrice.effective_period <= _period(period))
        .order_by(PlanPrice.effective_period.desc()).limit(1)
    ).first()
    if row is None:
        return None
    return Price(row.prompt_price, row.completion_price, row.adapter_surcharge_price, row.currency)


def set_plan_price(session: Session, plan_id: int | None, price: Price, effective_period: str | None = None) -> None:
    """plan_id None sets the price list of tenants without a plan."""
    if plan_id is not None and session.get(Plan, plan_id) is None:
        raise LookupError(f"no plan with id {plan_id}")
    period = _period(effective_period)
    _refuse_billed_periods(session, period)
    guard = _CurrencyGuard(session)
    row = session.scalars(
        select(PlanPrice).where(_plan_cond(plan_id), PlanPrice.effective_period == period)
    ).first()
    if row is None:
        row = PlanPrice(plan_id=plan_id, effective_period=period)
        session.add(row)
    row.prompt_price = price.prompt
    row.completion_price = price.completion
    row.adapter_surcharge_price = price.adapter_surcharge
    row.currency = price.currency
    session.flush()
    guard.check(f"pricing {'the no-plan list' if plan_id is None else 'this plan'} in {price.currency} from {period}")


def tenant_override(session: Session, tenant_id: int, period: str | None = None) -> PriceOverride | None:
    row = session.scalars(
        select(TenantPrice).where(TenantPrice.tenant_id == tenant_id, TenantPrice.effective_period <= _period(period))
        .order_by(TenantPrice.effective_period.desc()).limit(1)
    ).first()
    if row is None:
        return None
    override = PriceOverride(row.prompt_price, row.completion_price, row.adapter_surcharge_price)
    return None if override == PriceOverride() else override


def set_tenant_override(
    session: Session, tenant_id: int, override: PriceOverride | None, effective_period: str | None = None
) -> None:
    """None (or every field None) ends the override from `effective_period` on."""
    override = override or PriceOverride()
    for value in (override.prompt, override.completion, override.adapter_surcharge):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError("override prices must be non-negative integers of micro-units")
    period = _period(effective_period)
    _refuse_billed_periods(session, period, tenant_id)
    guard = _CurrencyGuard(session, [tenant_id])
    row = session.scalars(
        select(TenantPrice).where(TenantPrice.tenant_id == tenant_id, TenantPrice.effective_period == period)
    ).first()
    if row is None:
        row = TenantPrice(tenant_id=tenant_id, effective_period=period)
        session.add(row)
    row.prompt_price = override.prompt
    row.completion_price = override.completion
    row.adapter_surcharge_price = override.adapter_surcharge
    session.flush()
    guard.check("this override")


def plan_of(session: Session, tenant: Tenant, period: str | None = None) -> int | None:
    """The id of the plan `tenant` is on in `period` (default: now); None for no plan."""
    row = session.scalars(
        select(TenantPlan).where(TenantPlan.tenant_id == tenant.id, TenantPlan.effective_period <= _period(period))
        .order_by(TenantPlan.effective_period.desc()).limit(1)
    ).first()
    return tenant.plan_id if row is None else row.plan_id  # no history yet: the plan it has always had


def record_plan(session: Session, tenant: Tenant, plan_id: int | None) -> None:
    """Put `tenant` on plan `plan_id` (None: no plan) for the whole current month and on. Earlier months keep
    the plan they were on, so their statements and reports keep their prices and currency."""
    period = _period(None)
    guard = _CurrencyGuard(session, [tenant.id])
    if not session.scalar(select(func.count()).select_from(TenantPlan).where(TenantPlan.tenant_id == tenant.id)):
        # the plan so far holds for every earlier month (tenant.plan_id is still the old one here)
        session.add(TenantPlan(tenant_id=tenant.id, effective_period=ALWAYS, plan_id=tenant.plan_id))
        session.flush()
    if plan_of(session, tenant, period) != plan_id:
        row = session.scalars(
            select(TenantPlan).where(TenantPlan.tenant_id == tenant.id, TenantPlan.effective_period == period)
        ).first()
        if row is None:
            session.add(TenantPlan(tenant_id=tenant.id, effective_period=period, plan_id=plan_id))
        else:
            row.plan_id = plan_id
    tenant.plan_id = plan_id
    session.flush()
    guard.check("this plan change")


def price_for_tenant(session: Session, tenant: Tenant, period: str | None = None) -> Price:
    """The prices a tenant pays in `period` (default: now): the list of the plan it was on in that month,
    else the no-plan list, then its own overrides field by field."""
    plan_id = plan_of(session, tenant, period)
    plan = plan_price(session, plan_id, period) if plan_id is not None else None
    return effective_price(plan or plan_price(session, None, period), tenant_override(session, tenant.id, period))


def price_lists(session: Session, period: str | None = None) -> list[dict]:
    """Every plan with the prices in force in `period` and any later scheduled change, no-plan list first."""
    period = _period(period)
    plans: list[tuple[int | None, str]] = [(None, "(no plan)")]
    plans += [(p.id, p.name) for p in session.scalars(select(Plan).order_by(Plan.name))]
    out = []
    for plan_id, name in plans:
        scheduled = session.scalars(
            select(PlanPrice.effective_period).where(_plan_cond(plan_id), PlanPrice.effective_period > period)
            .order_by(PlanPrice.effective_period)
        ).all()
        out.append({"plan_id": plan_id, "plan": name, "price": plan_price(session, plan_id, period),
                    "scheduled": list(scheduled)})
    return out


__all__ = [
    "ALWAYS", "CurrencyConflict", "plan_of", "plan_price", "price_for_tenant", "price_lists", "record_plan",
    "set_plan_price", "set_tenant_override", "tenant_override",
]
