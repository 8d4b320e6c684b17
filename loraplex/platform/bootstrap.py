"""First start: create or upgrade the database, and make the admin key if there is none yet."""

from __future__ import annotations

import hashlib
import hmac

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from loraplex.config import Settings
from loraplex.platform.billing.locks import FIRST_START
from loraplex.platform.db import make_engine, make_session_factory, session_scope
from loraplex.platform.migrate import upgrade_to_head
from loraplex.platform.models import AdminKey, KeySecret
from loraplex.platform.tenants import create_admin_key


def prepare_database(settings: Settings) -> None:
    if settings.resolved_database_url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.resolved_database_url)


def key_secret_fingerprint(secret_key: str) -> str:
    return hmac.new(secret_key.encode(), b"loraplex-key-secret", hashlib.sha256).hexdigest()


def key_secret_problem(settings: Settings) -> str | None:
    """Why this process's LORAPLEX_SECRET_KEY cannot serve the database's keys (another secret made them), or
    None; a database that records no secret yet (a new one, or one from before the record) records this one."""
    mine = key_secret_fingerprint(settings.secret_key)
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            _lock_first_start(session)  # replicas starting together on a new database record one secret
            recorded = session.get(KeySecret, 1)
            if recorded is None:
                session.add(KeySecret(id=1, fingerprint=mine))
                return None
            if recorded.fingerprint == mine:
                return None
    finally:
        engine.dispose()
    return ("LORAPLEX_SECRET_KEY is not the secret this database's API keys were made with: every key would be "
            "refused, and keys made with it would work on no server; give every process the same "
            "LORAPLEX_SECRET_KEY")


def ensure_admin_key(settings: Settings) -> str | None:
    """The new admin key's secret when one was created now (print it once), else None.

    API replicas starting together on a new database each run this: the check and the insert happen under one
    lock, so exactly one of them makes (and prints) the key and the others find it.
    """
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            _lock_first_start(session)
            active = session.scalar(select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None)))
            if active:
                return None
            _, secret = create_admin_key(session, settings)
            return secret
    finally:
        engine.dispose()


def _lock_first_start(session: Session) -> None:
    """Hold the first-start lock until the session's transaction ends, so another process's check waits for
    this one's insert to commit."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:c, 0)"), {"c": FIRST_START})
    else:
        # pysqlite begins a transaction only at the first write: take SQLite's write lock before the check
        session.execute(text("BEGIN IMMEDIATE"))
