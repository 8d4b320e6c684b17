"""A database failure said in one line, for a command's error or a log line."""

from __future__ import annotations


def database_error(exc: BaseException) -> str:
    """The driver's own words (not SQLAlchemy's wrapper, with its statement and its "Background on this error"
    link), their lines joined (psycopg puts its hint on a second line)."""
    from sqlalchemy.exc import DBAPIError

    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return "; ".join(lines) or type(cause).__name__
