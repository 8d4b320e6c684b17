"""A database failure said in one line, for a command's error or a log line."""

from __future__ import annotations


def database_error(exc: BaseException) -> str:
    """The driver's own words (not SQLAlchemy's wrapper, with its statement and its "Background on this error"
    link), their lines joined (psycopg puts its hint on a second line)."""
    from sqlalchemy.exc import DBAPIError

    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return "; ".join(lines) or type(cause).__name__


def sqlite_path_problem(url: str) -> str | None:
    """Why SQLite cannot open a URL's file, with the path, where its own words ("unable to open database
    file") name neither; None for another database, or when nothing is wrong with the path."""
    import os
    from pathlib import Path

    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or path.startswith("file:"):
        return None
    file = Path(path).absolute()
    folder = file.parent
    try:
        if file.is_dir():
            return f"{file} is a folder, not a database file"
        if not folder.exists():
            existing = next((p for p in folder.parents if p.exists()), None)
            if existing is not None and not existing.is_dir():
                return f"its folder {folder} cannot exist: {existing} is a file, not a folder"
            return f"its folder {folder} does not exist"
        if not folder.is_dir():
            return f"its folder {folder} is a file, not a folder"
        if file.exists() and not os.access(file, os.R_OK | os.W_OK):
            return f"the file {file} is not readable and writable by this user"
        if not os.access(folder, os.W_OK | os.X_OK):  # SQLite creates the file, and its WAL journal, there
            return f"its folder {folder} is not writable by this user"
    except OSError as exc:  # a folder on the way that this user may not look into
        return f"cannot look up {file}: {exc.strerror or exc}"
    return None
