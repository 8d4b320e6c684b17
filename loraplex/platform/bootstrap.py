"""First start: create or upgrade the database, and make the admin key if there is none yet."""

from __future__ import annotations

from sqlalchemy import func, select

from loraplex.config import Settings
from loraplex.platform.db import make_engine, make_session_factory, session_scope
from loraplex.platform.migrate import upgrade_to_head
from loraplex.platform.models import AdminKey
from loraplex.platform.tenants import create_admin_key


def prepare_database(settings: Settings) -> None:
    if settings.resolved_database_url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.resolved_database_url)


def ensure_admin_key(settings: Settings) -> str | None:
    """The new admin key's secret when one was created now (print it once), else None.

    Concurrent first starts (several API processes) may race; the count check is a courtesy, not a lock, and
    a second admin key is harmless since each process prints the one it made.
    """
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            active = session.scalar(select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None)))
            if active:
                return None
            _, secret = create_admin_key(session, settings)
            return secret
    finally:
        engine.dispose()
