"""How adapter pins reach the engines. An operator's pin, unpin or prefetch goes to the engines at once
(`prefetch_in_engines`); and each process that holds an engine keeps that engine's pins equal to the
database's: once at start (an engine that restarted holds no pins of its own) and every `pin_sync_interval`
seconds after (a pin or unpin that did not reach this engine, or one made through another engine process)."""

from __future__ import annotations

import asyncio
import logging

from loraplex.engine.errors import AdapterLoadError, EngineOverloadedError, InvalidRequestError
from loraplex.platform.errors import not_found
from loraplex.platform.models import AdapterVersion
from loraplex.platform.outage import OutageLog, every
from loraplex.platform.tasks.context import TaskContext

log = logging.getLogger(__name__)


async def keep_pins_in_sync(ctx: TaskContext, interval: float) -> None:
    from loraplex.platform.tasks.jobs import sync_pins

    async def sync() -> None:
        pinned, unpinned = await asyncio.to_thread(sync_pins, ctx)
        if pinned or unpinned:
            log.info("adapter pins synced with the database: %d pinned, %d unpinned", pinned, unpinned)

    await every(interval, sync, OutageLog(log, "making the engine's adapter pins match the database", interval),
                at_start=True)


async def prefetch_in_engines(services, version_id: int, engine_pin: bool | None) -> str:
    """Prefetch a ready version and set its content's pin in the engines (this process's, or every engine
    process through the router); where that is not possible now, a pin or unpin already recorded in the
    database reaches the engines through their pin sync. Returns where it went (`PrefetchResult.where`);
    raises EngineOverloadedError for a plain prefetch that no engine could take."""
    from loraplex.platform.tasks.jobs import lora_request_for

    lora = lora_request_for(TaskContext(services.settings, services.sessions), version_id)
    if lora is None:  # deleted meanwhile
        raise not_found(f"no adapter version {version_id}", param="version_id")
    if services.engine is None:
        await services.tasks.send_async("loraplex.prefetch_adapter", version_id, engine_pin)
        return "queued"
    try:
        await services.engine.prefetch_adapter(lora, pin=engine_pin)
    except EngineOverloadedError as exc:  # no engine process, or none reachable
        if engine_pin is None:
            raise
        log.warning("adapter version %s: %s now (%s); the engines apply it at their next pin sync", version_id,
                    "pinning" if engine_pin else "unpinning", exc)
        return "sync"
    return "engine"


async def prefetch_keeping_pin_honest(services, version_id: int, engine_pin: bool | None, *, pin: bool | None,
                                      was_pinned: bool) -> str:
    """prefetch_in_engines after an operator's pin or unpin was recorded: where the engines cannot load the
    adapter (AdapterLoadError, InvalidRequestError) the version's pin goes back to what it was before the
    error is raised on, so that no pin is recorded that the engines' pin sync would keep failing to apply.
    The admin API and the console both prefetch through here."""
    try:
        return await prefetch_in_engines(services, version_id, engine_pin)
    except (AdapterLoadError, InvalidRequestError):
        if pin is not None:
            with services.sessions() as session:
                version = session.get(AdapterVersion, version_id)
                if version is not None:
                    version.pinned = was_pinned
                    session.commit()
        raise
