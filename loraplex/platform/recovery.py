"""Start-up repairs after a crash: staging folders of interrupted uploads, validations that never finished."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from sqlalchemy import select

from loraplex.platform.adapter_registry import TERMINAL, uploads_root
from loraplex.platform.models import AdapterVersion, VersionStatus
from loraplex.platform.services import Services

log = logging.getLogger(__name__)
STALE_STAGING_SECONDS = 3600  # another process may be receiving an upload right now


def remove_stale_staging(services: Services, *, older_than: float = STALE_STAGING_SECONDS) -> int:
    """Interrupted uploads (incoming-*), and the staged files of versions no validation will read again:
    gone, ready or failed (a worker that validated from another data directory cleared its own copy, not
    this one). A pending or validating version's files are its worker's to read."""
    root = uploads_root(services.settings)
    if not root.exists():
        return 0
    removed = 0
    for folder in root.glob("incoming-*"):
        if time.time() - folder.stat().st_mtime > older_than:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    for folder in _finished_version_folders(services, root, older_than):
        shutil.rmtree(folder, ignore_errors=True)
        removed += 1
    return removed


def _finished_version_folders(services: Services, root: Path, older_than: float) -> list[Path]:
    folders = {int(f.name): f for f in root.iterdir() if f.name.isdigit() and f.is_dir()}
    ids, status = list(folders), {}
    with services.sessions() as session:
        for start in range(0, len(ids), 500):  # (SQLite caps the parameters of one statement)
            status.update(session.execute(select(AdapterVersion.id, AdapterVersion.status)
                                          .where(AdapterVersion.id.in_(ids[start:start + 500]))).all())
    finished = []
    for version_id, folder in folders.items():
        if version_id not in status:
            # no row: deleted, or another process is registering it right now (the folder is moved in
            # before the row commits), so only an old one
            if time.time() - folder.stat().st_mtime > older_than:
                finished.append(folder)
        elif status[version_id] in TERMINAL:
            finished.append(folder)
    return finished


# pending or validating this long: its task was lost, or its worker died (a validation takes seconds; one
# sent again while the first still runs is harmless: validation is idempotent)
STUCK_VALIDATION_SECONDS = 120


def stuck_validations(sessions, *, older_than: float = STUCK_VALIDATION_SECONDS) -> list[int]:
    """Versions still pending or validating `older_than` seconds after their upload: a task lost on the way
    (the broker unreachable when it was sent), or one that failed on a database outage after its retries."""
    from datetime import UTC, datetime, timedelta

    cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
    with sessions() as session:
        return list(session.scalars(select(AdapterVersion.id).where(
            AdapterVersion.status.in_([VersionStatus.pending.value, VersionStatus.validating.value]),
            AdapterVersion.created_at < cutoff)))


def resume_validations(services: Services) -> int:
    """In-process tasks die with their process; the embedded default sends unfinished ones again (the task
    is idempotent). With a broker, Celery redelivers them itself (acks late)."""
    if not services.tasks.eager:
        return 0
    ids = stuck_validations(services.sessions, older_than=0)  # every one: none can be running at start
    for version_id in ids:
        services.tasks.send("loraplex.validate_adapter", version_id)
    if ids:
        log.info("resumed validation of %d adapter version(s)", len(ids))
    return len(ids)
