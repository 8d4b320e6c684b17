"""The in-flight ledger: the requests this process has admitted and not yet journaled, with the tokens each
has produced so far, so that a process killed mid-request (SIGKILL, a lost machine) still bills them.

Each process appends to its own file, under an exclusive flock, three kinds of line: `open` when a request
is admitted (everything its usage record needs but the counts), `cp` (a checkpoint: its counts so far) at
most every CHECKPOINT_SECONDS or CHECKPOINT_TOKENS tokens, and `close` once its usage record is journaled.
A ledger no live process holds (unlocked) belongs to a process that died: every request opened there and
never closed is settled from its last checkpoint as a usage record with status "interrupted", which the
request id keeps to one row however often that runs.

A line is one write() to an O_APPEND file: it reaches the kernel at once, so a killed process loses none;
`sync()` (each usage flush) puts them on disk, so a machine that dies loses at most the last flush interval.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from loraplex.platform.usage.event import UsageEvent
from loraplex.platform.usage.file_journal import remove_and_unlock, unheld_files

log = logging.getLogger(__name__)
INTERRUPTED = "interrupted"  # the status of a usage record settled from a checkpoint
# how often a running request's counts are checkpointed (whichever comes first)
CHECKPOINT_SECONDS = 1.0
CHECKPOINT_TOKENS = 64
# a ledger past this size is rewritten with only its open requests (closed ones need no line)
COMPACT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Interrupted:
    """A request a dead process left open: its usage record (as of its last checkpoint) and the month its
    quota reservation counted in."""

    event: UsageEvent
    month: str


class InflightLedger:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._open: dict[str, tuple[dict, dict | None]] = {}  # request id -> (open line, last checkpoint line)
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0
        self._dirty = False
        self._closed = False
        self._new_file()

    def _new_file(self) -> None:
        self._path = self.dir / f"inflight-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._size = 0

    def _write(self, line: dict) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, data)  # one write() of a whole line: O_APPEND keeps lines intact
        self._size += len(data)
        self._dirty = True

    def open(self, event: UsageEvent, month: str) -> None:
        """`event`: the request's usage record as it would read with no tokens yet (created_at: admission)."""
        line = {"op": "open", "id": event.request_id, "month": month, "event": vars(event)}
        with self._lock:
            if self._closed:
                return
            self._write(line)
            self._open[event.request_id] = (line, None)

    def checkpoint(self, request_id: str, prompt_tokens: int, completion_tokens: int, ttft_ms: int | None,
                   latency_ms: int) -> None:
        line = {"op": "cp", "id": request_id, "p": prompt_tokens, "c": completion_tokens, "ttft": ttft_ms,
                "lat": latency_ms}
        with self._lock:
            if self._closed or request_id not in self._open:
                return
            self._write(line)
            self._open[request_id] = (self._open[request_id][0], line)

    def close(self, request_id: str) -> None:
        """The request's usage record is journaled: nothing is left to settle for it."""
        with self._lock:
            if self._closed or self._open.pop(request_id, None) is None:
                return
            self._write({"op": "close", "id": request_id})
            if self._size >= COMPACT_BYTES:
                self._compact()

    def _compact(self) -> None:
        """A new file with the open requests' last lines, then the old one removed: a crash between the two
        leaves both, which recovery reads as one (the request id)."""
        old_fd, old_path = self._fd, self._path
        self._new_file()
        for open_line, cp_line in self._open.values():
            self._write(open_line)
            if cp_line is not None:
                self._write(cp_line)
        os.fsync(self._fd)
        old_path.unlink(missing_ok=True)
        os.close(old_fd)

    def sync(self) -> None:
        """Put what was written on disk (called once per usage flush, not per line)."""
        with self._lock:
            if self._closed or not self._dirty:
                return
            self._dirty = False
            fd = os.dup(self._fd)  # fsync outside the lock: the request path's writes do not wait for the disk
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def orphaned(self) -> list[tuple[Path, int, list[Interrupted]]]:
        """Ledgers no live process holds, each locked for the caller: (path, fd, the requests left open)."""
        return [(path, fd, interrupted_requests(path.read_bytes().splitlines()))
                for path, fd in unheld_files(self.dir, "inflight-*.jsonl", self._path)]

    done = staticmethod(remove_and_unlock)
    release = staticmethod(os.close)  # leave a ledger found by unheld_files for a later pass

    def close_file(self) -> None:
        """At shutdown, once every request has settled: an empty ledger is removed, one with requests still
        open (their settlement timed out) is left for recovery."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._open:
                self._path.unlink(missing_ok=True)
            else:
                os.fsync(self._fd)
            os.close(self._fd)


def interrupted_requests(lines: list[bytes]) -> list[Interrupted]:
    """The requests a ledger's lines open and never close, each as of its last checkpoint (none: no tokens)."""
    opened: dict[str, dict] = {}
    checkpoints: dict[str, dict] = {}
    closed: set[str] = set()
    for raw in lines:
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            op, request_id = line["op"], line["id"]
        except (ValueError, TypeError, KeyError):
            # only a write torn by the crash can be partial: the line before it stands
            log.warning("skipping an unreadable in-flight ledger line")
            continue
        if op == "open":
            opened.setdefault(request_id, line)
        elif op == "cp":
            checkpoints[request_id] = line
        elif op == "close":
            closed.add(request_id)
    out = []
    for request_id, line in opened.items():
        if request_id in closed:
            continue
        try:
            out.append(_settled(line, checkpoints.get(request_id)))
        except (ValueError, TypeError, KeyError):
            log.warning("skipping in-flight request %s: its ledger line is not a usage record", request_id)
    return out


def _settled(open_line: dict, cp: dict | None) -> Interrupted:
    fields = dict(open_line["event"])
    admitted = datetime.fromisoformat(fields["created_at"])
    latency_ms = int(cp["lat"]) if cp else 0
    fields.update(
        prompt_tokens=int(cp["p"]) if cp else 0, completion_tokens=int(cp["c"]) if cp else 0,
        ttft_ms=cp["ttft"] if cp else None, latency_ms=latency_ms, status=INTERRUPTED,
        # the record is dated when its last counted token was, as a finished one is dated when it ends
        created_at=(admitted + timedelta(milliseconds=latency_ms)).astimezone(UTC).isoformat())
    return Interrupted(UsageEvent(**fields), str(open_line["month"]))
