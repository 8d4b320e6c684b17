"""Run Alembic migrations from code: `loraplex migrate`, and `loraplex serve` unless LORAPLEX_AUTO_MIGRATE is
false, create or upgrade the database."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from loraplex.resources import resource_dir

MIGRATIONS_DIR = resource_dir("migrations")


def alembic_config(url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise RuntimeError(f"migrations not found at {MIGRATIONS_DIR}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_to_head(url: str) -> None:
    command.upgrade(alembic_config(url), "head")


def pending_upgrade(url: str) -> tuple[str | None, str] | None:
    """(the database's revision, None for one never migrated; this version's) when the database is behind
    this version of loraplex, else None. Reads only: creates nothing, not even a SQLite file's tables."""
    from pathlib import Path

    from sqlalchemy.engine import make_url

    from loraplex.platform.db import make_engine

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    parsed = make_url(url)
    if (parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:"
            and not parsed.database.startswith("file:") and not Path(parsed.database).exists()):
        return None, head  # connecting would create the file
    engine = make_engine(url, pooled=False)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    return None if current == head else (current, head)
