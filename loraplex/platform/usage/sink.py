"""The batch insert: ON CONFLICT (request_id) DO NOTHING, so replaying a journal is harmless."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.models import UsageRecord
from loraplex.platform.usage.event import UsageEvent


def insert_events(sessions: sessionmaker[Session], events: Sequence[UsageEvent]) -> int:
    """Insert the events not yet stored; returns how many rows were new."""
    if not events:
        return 0
    rows = list({e.request_id: e.to_row() for e in events}.values())
    with sessions() as session:
        dialect = session.get_bind().dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:  # pragma: no cover - only the two supported databases
            raise RuntimeError(f"unsupported database {dialect}")
        stmt = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
        result = session.connection().execute(stmt, rows)
        session.commit()
        # executemany rowcount is the sum over rows on both drivers; -1 would mean "unknown"
        return result.rowcount if result.rowcount >= 0 else len(rows)
