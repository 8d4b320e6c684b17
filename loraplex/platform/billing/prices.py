"""Reading and writing price lists and tenant overrides."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.billing.models import PlanPrice, TenantPriceOverride
from loraplex.platform.billing.pricing import DEFAULT_CURRENCY, Price, PriceOverride, effective_price
from loraplex.platform.models import Plan, Tenant


def _plan_row(session: Session, plan_id: int | None) -> PlanPrice | None:
    cond = PlanPrice.plan_id.is_(None) if plan_id is None else PlanPrice.plan_id == plan_id
    return session.scalars(select(PlanPrice).where(cond)).first()


def _as_price(row: PlanPrice | None) -> Price | None:
    if row is None:
        return None
    return Price(row.prompt_price, row.completion_price, row.adapter_surcharge_price, row.currency)


def plan_price(session: Session, plan_id: int | None) -> Price | None:
    return _as_price(_plan_row(session, plan_id))


def set_plan_price(session: Session, plan_id: int | None, price: Price) -> PlanPrice:
    """plan_id None sets the price list of tenants without a plan."""
    if plan_id is not None and session.get(Plan, plan_id) is None:
        raise LookupError(f"no plan with id {plan_id}")
    row = _plan_row(session, plan_id)
    if row is None:
        row = PlanPrice(plan_id=plan_id)
        session.add(row)
    row.prompt_price = price.prompt
    row.completion_price = price.completion
    row.adapter_surcharge_price = price.adapter_surcharge
    row.currency = price.currency
    session.flush()
    return row


def tenant_override(session: Session, tenant_id: int) -> PriceOverride | None:
    row = session.get(TenantPriceOverride, tenant_id)
    if row is None:
        return None
    return PriceOverride(row.prompt_price, row.completion_price, row.adapter_surcharge_price)


def set_tenant_override(session: Session, tenant_id: int, override: PriceOverride | None) -> None:
    """None (or an override with every field None) removes the override."""
    for value in (override.prompt, override.completion, override.adapter_surcharge) if override else ():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError("override prices must be non-negative integers of micro-units")
    row = session.get(TenantPriceOverride, tenant_id)
    empty = override is None or all(
        v is None for v in (override.prompt, override.completion, override.adapter_surcharge)
    )
    if empty:
        if row is not None:
            session.delete(row)
        session.flush()
        return
    if row is None:
        row = TenantPriceOverride(tenant_id=tenant_id)
        session.add(row)
    row.prompt_price = override.prompt
    row.completion_price = override.completion
    row.adapter_surcharge_price = override.adapter_surcharge
    session.flush()


def price_for_tenant(session: Session, tenant: Tenant) -> Price:
    return effective_price(plan_price(session, tenant.plan_id) or plan_price(session, None),
                           tenant_override(session, tenant.id))


def price_lists(session: Session) -> list[dict]:
    """Every plan with its price list (None where a plan has none), the no-plan default first."""
    default = plan_price(session, None)
    out = [{"plan_id": None, "plan": "(no plan)", "price": default}]
    for plan in session.scalars(select(Plan).order_by(Plan.name)):
        out.append({"plan_id": plan.id, "plan": plan.name, "price": plan_price(session, plan.id)})
    return out


__all__ = [
    "DEFAULT_CURRENCY", "plan_price", "price_for_tenant", "price_lists", "set_plan_price", "set_tenant_override",
    "tenant_override",
]
