"""API keys are stored only as a keyed hash plus a short display prefix."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime, utcnow
from loraplex.platform.models.tenant import Tenant


class Scope(StrEnum):
    inference = "inference"
    adapters = "adapters"
    usage = "usage"


ALL_SCOPES = tuple(s.value for s in Scope)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64), default="default")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(128))  # space-separated Scope values
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)  # NULL: never
    # written at most once a minute per key (loraplex.platform.key_use), so up to a minute behind
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    tenant: Mapped[Tenant] = relationship(lazy="joined")

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(self.scopes.split())


class AdminKey(Base):
    __tablename__ = "admin_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), default="admin")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class KeySecret(Base):
    """Which LORAPLEX_SECRET_KEY the database's key hashes are keyed with, as a fingerprint (one row): a
    process given another secret would hash every key differently, so that no key works, and the keys it
    made would work nowhere else. `loraplex serve` and `loraplex admin` refuse to run with another secret."""

    __tablename__ = "key_secret"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
