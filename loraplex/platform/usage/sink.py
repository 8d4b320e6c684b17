"""The batch insert: ON CONFLICT (request_id) DO NOTHING, so replaying a journal is harmless."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy.exc import OperationalError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.models import UsageRecord
from loraplex.platform.usage.event import UsageEvent

log = logging.getLogger(__name__)
# what a bad row (rather than a bad database) raises: driver data errors, and text the driver cannot encode
_ROW_REFUSED = (StatementError, ValueError)


def _insert(session: Session, rows: list[dict]) -> int:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported databases
        raise RuntimeError(f"unsupported database {dialect}")
    stmt = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
    result = session.connection().execute(stmt, rows)
    # executemany rowcount is the sum over rows on both drivers; -1 would mean "unknown"
    return result.rowcount if result.rowcount >= 0 else len(rows)


def insert_events(sessions: sessionmaker[Session], events: Sequence[UsageEvent]) -> int:
    """Insert the events not yet stored; returns how many rows were new.

    A database that is down raises (the journal keeps the events for the next try). A row the database
    refuses on its own (bad data) must not hold back every record behind it: the batch is retried row by
    row and such rows are logged and dropped.
    """
    if not events:
        return 0
    rows = list({e.request_id: e.to_row() for e in events}.values())
    with sessions() as session:
        try:
            inserted = _insert(session, rows)
            session.commit()
            return inserted
        except OperationalError:
            raise
        except _ROW_REFUSED:
            session.rollback()
        inserted = 0
        for row in rows:
            try:
                inserted += _insert(session, [row])
                session.commit()
            except OperationalError:
                raise
            except _ROW_REFUSED as exc:
                session.rollback()
                log.error("usage record %s refused by the database, dropped: %r", row["request_id"],
                          getattr(exc, "orig", None) or exc)
        return inserted
