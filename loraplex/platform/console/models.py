"""Console sessions live in the database so logout (and expiry) holds across every API process."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db import Base
from loraplex.platform.models._common import UTCDateTime, utcnow


class ConsoleSession(Base):
    __tablename__ = "console_sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # sha256 of the random session id carried (signed) in the cookie: a database leak yields no live cookie
    sid_hash: Mapped[str] = mapped_column(String(64), unique=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    admin_key_id: Mapped[int] = mapped_column(ForeignKey("admin_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
