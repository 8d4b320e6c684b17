"""Each process that holds an engine keeps that engine's adapter pins equal to the database's: once at start
(an engine that restarted holds no pins of its own) and every `pin_sync_interval` seconds after (a pin or
unpin that did not reach this engine, or one made through another engine process)."""

from __future__ import annotations

import asyncio
import logging

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
