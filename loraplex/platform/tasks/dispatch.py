"""Sending tasks: to the broker in production, to an in-process worker thread in the embedded default.

Either way the caller has committed first, so the task sees the rows it is about to work on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from loraplex.config import Settings

log = logging.getLogger(__name__)


class TaskDispatcher:
    def __init__(self, settings: Settings):
        from loraplex.platform.tasks.celery_app import app, configure

        configure(settings)
        self.app = app
        self.eager = settings.tasks_eager
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="loraplex-task") \
            if self.eager else None
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def send(self, name: str, *args, **kwargs) -> None:
        task = self.app.tasks[name]
        if self._pool is None:
            task.apply_async(args=args, kwargs=kwargs)
            return
        future = self._pool.submit(self._run_eager, task, args, kwargs)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    async def send_async(self, name: str, *args, **kwargs) -> None:
        if self._pool is None:  # publishing to Redis is network I/O: keep it off the event loop
            await asyncio.to_thread(self.send, name, *args, **kwargs)
        else:
            self.send(name, *args, **kwargs)

    @staticmethod
    def _run_eager(task, args, kwargs):
        result = task.apply(args=args, kwargs=kwargs)
        if result.failed():
            log.error("task %s%s failed: %r", task.name, args, result.result)
        return result

    def _forget(self, future) -> None:
        with self._lock:
            self._pending.discard(future)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for in-process tasks sent so far (tests and shutdown)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)
