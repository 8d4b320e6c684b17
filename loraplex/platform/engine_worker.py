"""The engine's own task queue, consumed inside the process that holds the engine (prefetch, remove)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import uuid

from loraplex.config import Settings

log = logging.getLogger(__name__)


class EngineQueueConsumer:
    """A one-thread Celery worker on `settings.engine_queue`; its tasks reach the engine through the task
    context (the engine and its event loop), set when the app or engine server starts."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._worker = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from celery.worker import WorkController

        from loraplex.platform.tasks.celery_app import configure

        app = configure(self.settings)
        self._worker = WorkController(
            app=app, hostname=f"engine-{uuid.uuid4().hex[:6]}@{socket.gethostname()}", pool="solo",
            concurrency=1, queues=[self.settings.engine_queue], without_heartbeat=True, without_mingle=True,
            without_gossip=True, loglevel="WARNING",
        )
        self._thread = threading.Thread(target=self._worker.start, name="loraplex-engine-queue", daemon=True)
        self._thread.start()
        log.info("consuming Celery queue %r in the engine process", self.settings.engine_queue)

    def stop(self) -> None:
        if self._worker is None:
            return
        try:
            self._worker.stop(in_sighandler=False)
        except Exception:
            log.exception("stopping the engine queue consumer failed")
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._worker = None


def consume_engine_queue_with_app(app) -> EngineQueueConsumer:
    services = app.state.services
    consumer = EngineQueueConsumer(services.settings)

    async def start(_services, _app) -> None:
        await asyncio.to_thread(consumer.start)

    async def stop(_services) -> None:
        await asyncio.to_thread(consumer.stop)

    services.startup_hooks.append(start)
    services.shutdown_hooks.append(stop)
    return consumer
