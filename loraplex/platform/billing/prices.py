"""Price lists and tenant overrides, each in force from a billing period (YYYY-MM) on.

A change names the first period it applies to (by default the current one, so the open month's draft
reflects it at once); months already billed keep the prices they were billed with, because a statement
looks up the rows in force for its own period.
"""

from __future__ import annotations

from sqlalchemy import func, or_, select
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


def _override_periods(session: Session, period: str, tenant_id: int | None = None) -> dict[int, list[str]]:
    """Per tenant with an override in force in `period` or starting later: the periods from which each of
    them applies (`period` itself for the one already in force)."""
    stmt = select(TenantPrice).where(or_(TenantPrice.prompt_price.is_not(None),
                                         TenantPrice.completion_price.is_not(None),
                                         TenantPrice.adapter_surcharge_price.is_not(None)))
    if tenant_id is not None:
        stmt = stmt.where(TenantPrice.tenant_id == tenant_id)
    out: dict[int, list[str]] = {}
    for row in session.scalars(stmt):
        if row.effective_period > period:
            out.setdefault(row.tenant_id, []).append(row.effective_period)
        elif tenant_override(session, row.tenant_id, period) is not None:
            out.setdefault(row.tenant_id, []).append(period)
    return {t: sorted(set(ps)) for t, ps in out.items()}


def _currencies(session: Session, periods: dict[int, list[str]]) -> dict[tuple[int, str], str]:
    tenants = {t.id: t for t in session.scalars(select(Tenant).where(Tenant.id.in_(list(periods))))}
    return {(tid, p): _base_currency(session, tenants[tid], p) for tid, ps in periods.items() for p in ps}


def _refuse_currency_changes(session: Session, before: dict[tuple[int, str], str], what: str) -> None:
    """After a change (flushed, not committed): refused when it moved an override to another currency."""
    moved = {}
    for (tid, period), currency in before.items():
        now = _base_currency(session, session.get(Tenant, tid), period)
        if now != currency:
            moved.setdefault(tid, (period, currency, now))
    if not moved:
        return
    names = sorted(session.get(Tenant, tid).name for tid in moved)
    period, old, new = next(iter(moved.values()))
    who = f"tenant {names[0]} has" if len(names) == 1 else f"tenants {', '.join(names[:10])}{' ...' if len(names) > 10 else ''} have"
    raise CurrencyConflict(
        f"{what} would bill {who} price overrides set in {old} in {new} (from {period}); change or clear "
        f"those overrides first, or keep the currency")


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
    before = _currencies(session, _override_periods(session, period))
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
    _refuse_currency_changes(session, before, f"pricing {'the no-plan list' if plan_id is None else 'this plan'} "
                                              f"in {price.currency}")


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
    before = _currencies(session, _override_periods(session, period, tenant.id))
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
    _refuse_currency_changes(session, before, "this plan change")


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
