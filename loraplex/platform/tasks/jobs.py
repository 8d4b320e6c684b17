"""Task bodies as plain functions of (context, ids), so the Celery wrappers stay one line each."""

from __future__ import annotations

import logging
import shutil
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import func, select

from loraplex.engine.lora_request import LoRARequest
from loraplex.platform.models import Adapter, AdapterVersion, UsageRecord, VersionStatus, utcnow
from loraplex.platform.registry import store_path
from loraplex.platform.tasks.context import TaskContext

log = logging.getLogger(__name__)


def validate_adapter(ctx: TaskContext, version_id: int) -> str:
    """pending -> validating -> ready | failed(reason). Returns the final status."""
    from loraplex.adapters import AdapterLimits, AdapterValidationError, load_adapter
    from loraplex.platform.adapter_registry import (
        UPLOAD_UNAVAILABLE,
        UPLOAD_UNAVAILABLE_MESSAGE,
        upload_source,
        version_upload_dir,
    )

    with ctx.sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:
            return "missing"  # deleted before we got to it
        if version.status in (VersionStatus.ready.value, VersionStatus.failed.value):
            return version.status
        version.status = VersionStatus.validating.value
        session.commit()
        source = upload_source(ctx.settings, version)
    try:
        if not source.exists():
            raise FileNotFoundError(source)
        adapter = load_adapter(source, ctx.base_spec, AdapterLimits.from_settings(ctx.settings))
        ctx.store.put(adapter)
    except AdapterValidationError as exc:
        _finish(ctx, version_id, status=VersionStatus.failed, error=str(exc), error_code=exc.code.value)
        return VersionStatus.failed.value
    except FileNotFoundError:
        # The staged upload itself is gone: a server problem, not the tenant's adapter, and the path is the
        # server's business (the log's, not the tenant's)
        status = _finish(ctx, version_id, status=VersionStatus.failed, error=UPLOAD_UNAVAILABLE_MESSAGE,
                         error_code=UPLOAD_UNAVAILABLE)
        if status != "missing":  # (a delete during the validation takes the files too: nothing wrong then)
            log.error("adapter version %s: its staged upload %s is missing on this worker; API processes and "
                      "workers must share LORAPLEX_DATA_DIR (here %s), or the upload was removed",
                      version_id, source, ctx.settings.data_dir)
        return status
    status = _finish(ctx, version_id, status=VersionStatus.ready, content_hash=adapter.content_hash,
                     rank=adapter.rank, target_modules=",".join(adapter.target_modules))
    if status == "missing":  # deleted while we validated: the store entry is ours to drop unless in use
        _drop_unreferenced(ctx, adapter.content_hash)
    elif not ctx.store.exists(adapter.content_hash):
        # another adapter with these weights was deleted between our put and our commit, and took the
        # entry it saw no version refer to yet: write it again
        ctx.store.put(adapter)
    shutil.rmtree(version_upload_dir(ctx.settings, version_id), ignore_errors=True)
    return status


def _drop_unreferenced(ctx: TaskContext, content_hash: str) -> None:
    from loraplex.platform.adapter_registry import content_in_use

    with ctx.sessions() as session:
        used = content_in_use(session, content_hash)
    if not used:
        ctx.store.delete(content_hash)


def _finish(ctx: TaskContext, version_id: int, *, status: VersionStatus, **fields) -> str:
    from loraplex.platform.adapter_registry import version_upload_dir

    with ctx.sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:  # deleted while we validated: drop what we made
            return "missing"
        version.status = status.value
        for key, value in fields.items():
            setattr(version, key, value)
        if status == VersionStatus.ready:
            version.ready_at = utcnow()
        session.commit()
    if status == VersionStatus.failed:
        shutil.rmtree(version_upload_dir(ctx.settings, version_id), ignore_errors=True)
    return status.value


def lora_request_for(ctx: TaskContext, version_id: int) -> LoRARequest | None:
    with ctx.sessions() as session:
        row = session.execute(
            select(AdapterVersion.content_hash, Adapter.name)
            .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
            .where(AdapterVersion.id == version_id, AdapterVersion.status == VersionStatus.ready.value)
        ).first()
    if row is None:
        return None
    content_hash, name = row
    return LoRARequest(name=name, content_hash=content_hash,
                       path=store_path(ctx.settings.resolved_adapter_store_dir.resolve(), content_hash))


def prefetch_adapter(ctx: TaskContext, version_id: int, pin: bool | None = None) -> bool:
    """Warm a ready version into this process's engine (device slot, else host cache). With pin True or
    False its content's pin there is set to what the database holds now (the pin sent may be stale: a task
    queued while no engine ran, an unpin made since); None leaves the pin as it was."""
    lora = lora_request_for(ctx, version_id)
    if lora is None:
        return False
    if pin is not None:
        from loraplex.platform.adapter_registry import content_pinned

        with ctx.sessions() as session:
            pin = content_pinned(session, lora.content_hash)
    if ctx.engine is None:
        raise RuntimeError("prefetch_adapter runs only in a process that holds an engine "
                           f"(it is routed to the '{ctx.settings.engine_queue}' queue)")
    ctx.call_engine(lambda engine: engine.prefetch_adapter(lora, pin=pin))
    return True


def remove_adapter(ctx: TaskContext, content_hash: str) -> bool:
    if ctx.engine is None:
        return False
    ctx.call_engine(lambda engine: engine.remove_adapter(content_hash))
    return True


def busiest_versions(ctx: TaskContext, *, within: timedelta = timedelta(hours=1), limit: int | None = None
                     ) -> list[int]:
    """Ready version ids by requests in the last `within`, busiest first."""
    since = datetime.now(UTC) - within
    limit = limit or ctx.settings.max_loras
    with ctx.sessions() as session:
        counts = (select(UsageRecord.adapter_version.label("h"), func.count().label("n"))
                  .where(UsageRecord.created_at >= since, UsageRecord.adapter_version.is_not(None))
                  .group_by(UsageRecord.adapter_version).subquery())
        stmt = (select(func.max(AdapterVersion.id), counts.c.n)
                .join(counts, counts.c.h == AdapterVersion.content_hash)
                .where(AdapterVersion.status == VersionStatus.ready.value)
                .group_by(AdapterVersion.content_hash, counts.c.n)
                .order_by(counts.c.n.desc()).limit(limit))
        return [vid for vid, _n in session.execute(stmt)]


def pinned_versions(ctx: TaskContext) -> list[int]:
    """One ready version id per pinned content (an operator's pins, kept in the database): what an engine
    that started since they were set must pin again."""
    with ctx.sessions() as session:
        stmt = (select(func.max(AdapterVersion.id))
                .where(AdapterVersion.status == VersionStatus.ready.value, AdapterVersion.pinned.is_(True))
                .group_by(AdapterVersion.content_hash))
        return sorted(session.scalars(stmt))


_unpinnable: set[str] = set()  # contents whose pinning failed (warned about once)


def sync_pins(ctx: TaskContext) -> tuple[int, int]:
    """This process's engine pinned as the database says (the operators' pins): every pinned ready content
    pinned, and a pin the database no longer holds undone (unpinned or deleted while this engine was away or
    unreachable). Runs in each process that holds an engine, at start and every `pin_sync_interval`, so an
    engine that restarts, or one an unpin did not reach, converges. Returns (pinned, unpinned)."""
    engine = ctx.engine
    if engine is None or not hasattr(engine, "pinned_adapters"):
        return 0, 0

    async def held(e) -> set[str] | None:
        return e.pinned_adapters()

    have = ctx.call_engine(held)
    if have is None:  # an engine without adapter support holds no pins
        return 0, 0
    with ctx.sessions() as session:
        stmt = (select(AdapterVersion.content_hash, func.max(AdapterVersion.id))
                .where(AdapterVersion.status == VersionStatus.ready.value, AdapterVersion.pinned.is_(True))
                .group_by(AdapterVersion.content_hash))
        wanted = dict(session.execute(stmt).all())
    pinned = unpinned = 0
    for content_hash, version_id in sorted(wanted.items()):
        if content_hash not in have:
            try:
                pinned += prefetch_adapter(ctx, version_id, pin=True)
            except Exception as exc:  # one unloadable entry does not keep the others unpinned
                # said once per content (the sync retries it every run), then at DEBUG
                level = logging.DEBUG if content_hash in _unpinnable else logging.WARNING
                _unpinnable.add(content_hash)
                log.log(level, "pinning adapter %s (version %s) failed: %s", content_hash[:12], version_id, exc)
            else:
                _unpinnable.discard(content_hash)
    for content_hash in sorted(have - wanted.keys()):
        ctx.call_engine(lambda e, h=content_hash: e.unpin_adapter(h))
        unpinned += 1
    return pinned, unpinned


def rollup_usage(ctx: TaskContext, day: str | None = None) -> int:
    """Rebuild daily rollups (billing) for `day`, or for yesterday and today."""
    try:
        from loraplex.platform.billing.rollups import rollup_day
    except ModuleNotFoundError as exc:
        raise RuntimeError("usage rollups need the billing module (loraplex.platform.billing)") from exc
    today = datetime.now(UTC).date()
    days = [date.fromisoformat(day)] if day else [today - timedelta(days=1), today]
    rows = 0
    with ctx.sessions() as session:
        for d in days:
            rows += rollup_day(session, d)
        session.commit()
    return rows
