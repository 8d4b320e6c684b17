"""Where loraplex's non-Python files live: the Alembic migrations and the admin console's web assets.

In a source checkout (and an editable install) they sit beside the package, at the repository root. A
wheel installs them as data files under `<prefix>/share/loraplex/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def resource_dir(name: str, *, prefixes: tuple[str, ...] | None = None) -> Path:
    """The directory `name` ("migrations" or "web"): the checkout's if present, else the installed one.
    When neither exists the checkout's path is returned, for the caller's error message."""
    source = _SOURCE_ROOT / name
    if source.is_dir():
        return source
    for prefix in prefixes if prefixes is not None else (sys.prefix, sys.base_prefix):
        installed = Path(prefix) / "share" / "loraplex" / name
        if installed.is_dir():
            return installed
    return source


def make_folder(path: Path) -> None:
    """Create `path` and its parents; an OSError whose message says in words why it cannot be a folder."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if path.exists() and not path.is_dir():
            reason = "it is a file, not a folder"
        elif isinstance(exc, (FileExistsError, NotADirectoryError)):
            reason = "a part of its path is a file, not a folder"
        else:
            reason = exc.strerror or str(exc)
        raise OSError(exc.errno, reason) from exc
