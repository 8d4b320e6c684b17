"""An adapter is a tenant's name; each upload is an immutable version named by its content hash."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint, false
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime, utcnow


class VersionStatus(StrEnum):
    pending = "pending"
    validating = "validating"
    ready = "ready"
    failed = "failed"


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    description: Mapped[str | None] = mapped_column(String(512), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", passive_deletes=True,
        order_by="AdapterVersion.id",
    )


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    # ids name versions in admin calls and console links: never handed out twice (SQLite reuses the largest
    # freed id without AUTOINCREMENT)
    __table_args__ = (Index("ix_adapter_versions_tenant_id_content_hash", "tenant_id", "content_hash"),
                      {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    # denormalised so tenant scoping is one WHERE clause, as for every tenant-owned table
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default=VersionStatus.pending.value)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    upload_sha256: Mapped[str] = mapped_column(String(64))
    upload_filename: Mapped[str] = mapped_column(String(256))
    upload_bytes: Mapped[int] = mapped_column(BigInteger)
    content_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target_modules: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # pinned in the engines' cache by an operator; the engine keeps a content pinned while any ready version
    # of it is (tenants who uploaded the same weights share the cached copy, not each other's pins)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    adapter: Mapped[Adapter] = relationship(back_populates="versions")

    @property
    def version(self) -> str | None:
        """The short version users type after '@': the first 12 hex digits of the content hash."""
        return self.content_hash[:12] if self.content_hash else None

    @property
    def adapter_name(self) -> str:
        return self.adapter.name

    @property
    def model(self) -> str | None:
        """The model name that requests exactly this version (`name@version`), while it is ready."""
        ready = self.content_hash and self.status == VersionStatus.ready.value
        return f"{self.adapter.name}@{self.version}" if ready else None
