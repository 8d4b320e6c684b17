"""Billing tables: price lists, tenant price overrides, daily usage rollups, monthly statements."""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import BigInteger, Date, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime, utcnow

NO_KEY = 0  # api_key_id of usage not made with an API key (the console playground)
BASE_ADAPTER = ""  # adapter_name / adapter_version of requests served by the base model alone
ALWAYS = "2000-01"  # effective_period of prices that hold for every period


class PlanPrice(Base):
    """Micro-units per million tokens, in force from `effective_period` (YYYY-MM) until a later row.
    plan_id NULL is the price list of tenants without a plan. Rows are never edited in place for a period
    that has passed, so a statement can always be recomputed with the prices of its month."""

    __tablename__ = "plan_prices"
    __table_args__ = (UniqueConstraint("plan_id", "effective_period", name="uq_plan_prices_plan_id_period"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), nullable=True)
    effective_period: Mapped[str] = mapped_column(String(7), default=ALWAYS)
    currency: Mapped[str] = mapped_column(String(3), default="USD")
    prompt_price: Mapped[int] = mapped_column(BigInteger)
    completion_price: Mapped[int] = mapped_column(BigInteger)
    adapter_surcharge_price: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class TenantPrice(Base):
    """A tenant's exceptions from `effective_period` on; NULL keeps the plan's price for that component
    (a row with every price NULL ends an earlier override)."""

    __tablename__ = "tenant_prices"
    __table_args__ = (UniqueConstraint("tenant_id", "effective_period", name="uq_tenant_prices_tenant_id_period"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    effective_period: Mapped[str] = mapped_column(String(7), default=ALWAYS)
    prompt_price: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    completion_price: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    adapter_surcharge_price: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class TenantPlan(Base):
    """The plan a tenant is on from `effective_period` (YYYY-MM) until a later row; plan_id NULL is no plan.
    Statements and reports price a month at the plan of that month, so a plan change re-prices neither
    billed months nor any month before the one it is made in."""

    __tablename__ = "tenant_plans"
    __table_args__ = (UniqueConstraint("tenant_id", "effective_period", name="uq_tenant_plans_tenant_id_period"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    effective_period: Mapped[str] = mapped_column(String(7), default=ALWAYS)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"), nullable=True)


class UsageRollup(Base):
    """Usage of one UTC day per tenant, key and adapter version. Rebuilt whole by each rollup run of the day."""

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint(
            "day", "tenant_id", "api_key_id", "adapter_name", "adapter_version",
            name="uq_usage_rollups_day_group",
        ),
        Index("ix_usage_rollups_tenant_id_day", "tenant_id", "day"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    day: Mapped[date] = mapped_column(Date)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # sentinels instead of NULL so the unique constraint holds on every database
    api_key_id: Mapped[int] = mapped_column(Integer, default=NO_KEY)
    adapter_name: Mapped[str] = mapped_column(String(64), default=BASE_ADAPTER)
    adapter_version: Mapped[str] = mapped_column(String(64), default=BASE_ADAPTER)
    requests: Mapped[int] = mapped_column(Integer)
    failed_requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    latency_ms_total: Mapped[int] = mapped_column(BigInteger)


class RollupRun(Base):
    """Which days have been rolled up; reports aggregate raw records live for the days not listed."""

    __tablename__ = "usage_rollup_runs"

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    records: Mapped[int] = mapped_column(Integer)
    rolled_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Statement(Base):
    __tablename__ = "statements"
    __table_args__ = (UniqueConstraint("tenant_id", "period", name="uq_statements_tenant_id_period"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    period: Mapped[str] = mapped_column(String(7))  # YYYY-MM, UTC calendar month
    status: Mapped[str] = mapped_column(String(16), default="final")
    currency: Mapped[str] = mapped_column(String(3))
    requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    total_amount: Mapped[int] = mapped_column(BigInteger)
    generated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    lines: Mapped[list[StatementLine]] = relationship(
        back_populates="statement", cascade="all, delete-orphan", passive_deletes=True,
        order_by="StatementLine.position",
    )


class StatementLine(Base):
    __tablename__ = "statement_lines"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    statement_id: Mapped[int] = mapped_column(ForeignKey("statements.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    adapter: Mapped[str] = mapped_column(String(128))  # name@version, or "" for the base model
    component: Mapped[str] = mapped_column(String(32))
    tokens: Mapped[int] = mapped_column(BigInteger)
    unit_price: Mapped[int] = mapped_column(BigInteger)  # micro-units per million tokens
    amount: Mapped[int] = mapped_column(BigInteger)

    statement: Mapped[Statement] = relationship(back_populates="lines")
