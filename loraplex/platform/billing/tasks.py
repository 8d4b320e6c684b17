"""Billing's periodic work, as plain functions of a session factory (the Celery wrappers are one line)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.billing.periods import previous_period
from loraplex.platform.billing.statements import finalize_period, is_closed


def finalize_last_month(sessions: sessionmaker[Session], now: datetime | None = None) -> int:
    """Finalize last month's statements for every tenant once the month is closed; idempotent, so the
    schedule may run it daily and a redelivered task changes nothing. Returns statements finalized or kept."""
    now = now or datetime.now(UTC)
    period = previous_period(now.date())
    if not is_closed(period, now):
        return 0
    with sessions() as session:
        count = finalize_period(session, period, now=now)
        session.commit()
    return count
