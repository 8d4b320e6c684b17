"""Store entries of deleted content stay until nothing can still load them.

A delete takes the database rows at once, but requests accepted before it may still wait in an engine's
queue for a device slot, and load the version they resolved to from the store only then. So a delete
retires the content (a marker `.retired/<hash>`, whose mtime says when) instead of removing its file, and a
sweep removes a retired entry once its grace period has passed, this process's accepted requests no longer
use it, and the database (checked again, just before) has no version referring to it: an upload of the
same weights meanwhile keeps it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

from loraplex.adapters import LocalAdapterStore
from loraplex.adapters.store import HASH_RE

log = logging.getLogger(__name__)
RETIRED = ".retired"


class ContentLeases:
    """Content hashes this process's accepted requests use, counted: from admission to settlement."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, content_hash: str) -> None:
        with self._lock:
            self._counts[content_hash] += 1

    def release(self, content_hash: str) -> bool:
        """True when that was the last request using it."""
        with self._lock:
            self._counts[content_hash] -= 1
            if self._counts[content_hash] > 0:
                return False
            del self._counts[content_hash]
            return True

    def held(self, content_hash: str) -> bool:
        with self._lock:
            return self._counts[content_hash] > 0


def retired_dir(store_dir: Path) -> Path:
    return Path(store_dir) / RETIRED


def retire(store_dir: Path, content_hashes: list[str]) -> None:
    """Mark content no version refers to any more as due for removal (the marker's mtime: since when)."""
    folder = retired_dir(store_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for content_hash in content_hashes:
        (folder / content_hash).touch()


def is_retired(store_dir: Path, content_hash: str) -> bool:
    return (retired_dir(store_dir) / content_hash).exists()


def sweep(sessions, store_dir: Path, *, grace_seconds: float, leases: ContentLeases | None = None,
          only: list[str] | None = None) -> list[str]:
    """Remove the retired entries that are due; returns the content hashes removed from the store."""
    from loraplex.platform.adapter_registry import content_in_use

    folder = retired_dir(store_dir)
    if not folder.is_dir():
        return []
    store = LocalAdapterStore(store_dir)
    names = only if only is not None else sorted(p.name for p in folder.iterdir())
    removed = []
    for content_hash in names:
        marker = folder / content_hash
        if not HASH_RE.fullmatch(content_hash):
            continue
        try:
            age = time.time() - marker.stat().st_mtime
        except FileNotFoundError:
            continue  # swept by another process, or not retired
        if age < grace_seconds or (leases is not None and leases.held(content_hash)):
            continue
        with sessions() as session:
            used = content_in_use(session, content_hash)
        if not used and store.delete(content_hash):
            removed.append(content_hash)
        marker.unlink(missing_ok=True)
    if removed:
        log.info("removed %d deleted adapter version(s) from the store", len(removed))
    return removed
