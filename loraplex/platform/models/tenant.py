"""Plans carry default quotas; a tenant may override any of them."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, func
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime, utcnow


class TenantStatus(StrEnum):
    active = "active"
    suspended = "suspended"


class Plan(Base):
    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)  # and unique whatever its case (the index below)
    requests_per_minute: Mapped[int] = mapped_column(Integer)
    tokens_per_minute: Mapped[int] = mapped_column(Integer)
    max_concurrent: Mapped[int] = mapped_column(Integer)
    monthly_token_budget: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index("uq_plans_name_lower", func.lower(name), unique=True),)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)  # and unique whatever its case (the index below)
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.active.value)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"), nullable=True)
    # NULL: take the plan's value (or the service default when the tenant has no plan)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    plan: Mapped[Plan | None] = relationship(lazy="joined")

    __table_args__ = (Index("uq_tenants_name_lower", func.lower(name), unique=True),)
