"""A Core SELECT for the per-request path, run straight on the pool's DBAPI connection.

Every call still asks the database (nothing is cached but the SQL text), so a revoked key fails on its very
next request. What it skips is SQLAlchemy's per-execution machinery (Connection, execution context, cache
key, Result): on SQLite that was about 45 of the 60 microseconds an API-key lookup took.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import Engine, Select
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError


class _Prepared:
    def __init__(self, stmt: Select, dialect: Dialect):
        compiled = stmt.compile(dialect=dialect)
        for name, bind in compiled.binds.items():
            if bind.type.dialect_impl(dialect).bind_processor(dialect) is not None:
                raise ValueError(f"bind parameter {name!r} needs type processing; use an ordinary execute")
        self.sql = str(compiled)
        self.compiled = compiled
        self.positions = compiled.positiontup if compiled.positional else None
        # Result processing as SQLAlchemy would do it (SQLite returns DATETIME columns as text, for instance).
        self.processors: list[Callable[[Any], Any] | None] = [
            col.type.dialect_impl(dialect).result_processor(dialect, None) for col in stmt.selected_columns
        ]

    def params(self, values: Mapping[str, Any]) -> tuple | dict:
        merged = self.compiled.construct_params(dict(values))  # adds the statement's own literals (LIMIT ...)
        return tuple(merged[name] for name in self.positions) if self.positions is not None else merged

    def row(self, raw: tuple) -> tuple:
        return tuple(value if proc is None else proc(value) for value, proc in zip(raw, self.processors, strict=True))


class HotQuery:
    """`HotQuery(select(...).where(col == bindparam("x"))).first(db, x=...)`: the first row as a tuple (with
    the columns' result types applied), or None. Bind parameters must be plain values (ints, strings)."""

    def __init__(self, stmt: Select):
        self.stmt = stmt
        self._prepared: WeakKeyDictionary[Dialect, _Prepared] = WeakKeyDictionary()  # per engine, freed with it

    def _for(self, dialect: Dialect) -> _Prepared:
        prepared = self._prepared.get(dialect)
        if prepared is None:
            prepared = self._prepared[dialect] = _Prepared(self.stmt, dialect)
        return prepared

    def first(self, db: Engine, **values: Any) -> tuple | None:
        """Errors are SQLAlchemy's, as an ordinary execute raises them (a database that does not answer is an
        `sqlalchemy.exc.OperationalError`, which the API answers with a 503), never the driver's own."""
        prepared = self._for(db.dialect)
        params = prepared.params(values)
        driver_error = db.dialect.loaded_dbapi.Error
        try:
            conn = db.raw_connection()  # pooled; returning it rolls back whatever the driver opened
        except driver_error as exc:
            raise DBAPIError.instance(prepared.sql, params, exc, driver_error) from exc
        try:
            cursor = conn.cursor()
            try:
                cursor.execute(prepared.sql, params)
                raw = cursor.fetchone()
            finally:
                cursor.close()
        except driver_error as exc:
            disconnected = db.dialect.is_disconnect(exc, conn.dbapi_connection, None)
            if disconnected:  # not back into the pool for the next request to fail on
                conn.invalidate(exc)
            raise DBAPIError.instance(prepared.sql, params, exc, driver_error,
                                      connection_invalidated=disconnected) from exc
        finally:
            conn.close()
        return None if raw is None else prepared.row(raw)
