"""One row per request; the request id makes a replayed write harmless."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # no foreign keys to keys/adapters: usage outlives a revoked key or a deleted adapter
    api_key_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    model: Mapped[str] = mapped_column(String(192))  # name@version, the version up to a whole hash
    adapter_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    adapter_version: Mapped[str | None] = mapped_column(String(64), nullable=True)  # content hash
    endpoint: Mapped[str] = mapped_column(String(32))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    ttft_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    latency_ms: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # ok | cancelled | error | interrupted
    end_user: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
