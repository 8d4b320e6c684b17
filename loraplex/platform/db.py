"""Database engine and sessions. SQLite for the embedded default, PostgreSQL in production."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import NullPool

# Stable constraint names keep Alembic autogenerate and PostgreSQL/SQLite migrations in step.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def normalize_url(url: str) -> str:
    """`postgresql://` means psycopg 3 to SQLAlchemy 2.1, and `postgresql+psycopg://` names it; use psycopg2
    (what loraplex installs) when psycopg 3 is not installed. `postgres://` (Heroku-style) too."""
    if url.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None:
            return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def make_engine(url: str, *, pooled: bool = True) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        kwargs = {} if pooled else {"poolclass": NullPool}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if not pooled:
        return create_engine(url, poolclass=NullPool)
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets readers (auth lookups) proceed while the usage flusher writes.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def import_all_models() -> None:
    """Register every table on Base.metadata, including optional areas that add their own."""
    import importlib

    import loraplex.platform.models  # noqa: F401

    for optional in ("loraplex.platform.billing.models", "loraplex.platform.console.models"):
        try:
            importlib.import_module(optional)
        except ModuleNotFoundError as exc:
            if exc.name != optional:
                raise
