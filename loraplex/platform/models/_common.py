from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime, TypeDecorator

from loraplex.platform.ids import MAX_ROW_ID

__all__ = ["MAX_ROW_ID", "UTCDateTime", "utcnow"]


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC timestamps on both SQLite (which drops the zone) and PostgreSQL."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given where UTC was expected")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect):
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value
