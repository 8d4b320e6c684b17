"""A per-process append-only journal file: the embedded default's journal, and the spool of the Redis
journal's records while Redis does not answer.

Each process writes its own file and holds an exclusive flock on it, so the flusher of any process can
tell a live journal (locked) from one a crashed process left behind (unlocked) and replay the latter.
A write reaches the OS before the response completes, so a process crash loses nothing that finished.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import uuid
from pathlib import Path

from loraplex.platform.usage.event import UsageEvent

log = logging.getLogger(__name__)


def remove_and_unlock(path: Path, fd: int) -> None:
    """A file found by unheld_files is handled: remove it, then drop its lock."""
    path.unlink(missing_ok=True)
    os.close(fd)


class FileJournal:
    def __init__(self, directory: Path, *, open_now: bool = True):
        """open_now=False: this process's file is made by its first append (a spool that may never be
        written), while the journals other processes left are replayable from the start."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None
        self._dirty = False
        self._closed = False
        self._lazy = not open_now
        if open_now:
            self._open_new()

    def _open_new(self) -> None:
        self._path = self.dir / f"journal-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._dirty = False

    def append(self, event: UsageEvent) -> None:
        data = (event.to_json() + "\n").encode()
        with self._lock:
            if self._closed:
                raise RuntimeError("usage journal is closed")
            if self._fd is None:
                self._open_new()
            os.write(self._fd, data)  # one write() of a whole line: O_APPEND keeps lines intact
            self._dirty = True

    def seal(self) -> None:
        """Close the current file (it becomes replayable) and start a new one."""
        with self._lock:
            if self._fd is None or not self._dirty:
                return
            old_fd = self._fd
            if self._lazy:
                self._fd, self._path = None, None
            else:
                self._open_new()
        os.close(old_fd)  # releases the flock: the old file is now fair game for replay

    def replayable(self) -> list[tuple[Path, int, list[UsageEvent]]]:
        """Journals no live process holds, each locked for the caller: (path, fd, events)."""
        return [(path, fd, _read_events(path)) for path, fd in unheld_files(self.dir, "journal-*.jsonl", self._path)]

    done = staticmethod(remove_and_unlock)
    release = staticmethod(os.close)  # leave a file found by unheld_files for a later pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def unheld_files(folder: Path, pattern: str, own: Path | None) -> list[tuple[Path, int]]:
    """The files matching `pattern` in `folder` that no live process holds (their writer's flock is gone),
    each opened and locked for the caller, who removes it or closes the fd; `own` (this process's) is skipped."""
    out = []
    for path in sorted(folder.glob(pattern)):
        if path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if not path.exists():  # handled and removed by another process meanwhile
            os.close(fd)
            continue
        out.append((path, fd))
    return out


def _read_events(path: Path) -> list[UsageEvent]:
    events = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            events.append(UsageEvent.from_json(line))
        except (ValueError, TypeError):
            # Only a write torn by a crash can be partial, and then its response never completed.
            log.warning("skipping unreadable usage journal line in %s", path.name)
    return events
