"""Serializing billing writers that may run at once (a redelivered task next to the original, or two beats).

On PostgreSQL a transaction-scoped advisory lock makes the second writer wait for the first to commit, so it
rebuilds from the committed state instead of colliding with the first's inserts. SQLite serializes writers
with its database lock already.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

ROLLUP_DAY = 0x6C700001  # lock class ids: arbitrary, distinct from anything else taking advisory locks
STATEMENT_TENANT = 0x6C700002
FIRST_START = 0x6C700003  # the first-start admin key (bootstrap.py); kept here so the ids stay distinct


def serialize(session: Session, lock_class: int, key: int) -> None:
    """Hold (lock_class, key) until the session's transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:c, :k)"), {"c": lock_class, "k": key})
