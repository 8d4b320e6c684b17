"""Alembic environment: one metadata for every area's tables, one URL source (Settings)."""

from __future__ import annotations

from alembic import context

from loraplex.platform.db import Base, import_all_models, make_engine

config = context.config
import_all_models()
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from loraplex.config import Settings

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url(), pooled=False)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


# Several processes may start on one new database at once (API replicas, an admin command beside them):
# on PostgreSQL each takes this transaction-scoped advisory lock before it reads the schema's version, so
# the second waits for the first's migrations to commit and then finds nothing left to do.
MIGRATION_LOCK_KEY = 0x6C6F7261706C6578  # "loraplex"


def _run(connection) -> None:
    # batch mode lets ALTER-style migrations work on SQLite too
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
