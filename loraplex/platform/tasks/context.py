"""What a task needs, per process: the database, the adapter store and, in an engine process, the engine."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from functools import cached_property

from sqlalchemy.orm import Session, sessionmaker

from loraplex.config import Settings
from loraplex.engine.client import EngineClient

ENGINE_CALL_TIMEOUT = 300.0


@dataclass
class TaskContext:
    settings: Settings
    sessions: sessionmaker[Session]
    engine: EngineClient | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the loop the engine runs on

    @cached_property
    def store(self):
        from loraplex.adapters import LocalAdapterStore

        return LocalAdapterStore(self.settings.resolved_adapter_store_dir)

    @cached_property
    def base_spec(self):
        from loraplex.adapters import BaseModelSpec
        from loraplex.engine.model_loader import resolve_model_dir

        return BaseModelSpec.from_model_dir(resolve_model_dir(self.settings.model))

    def call_engine(self, coro_factory):
        """Run an engine coroutine on the engine's own loop from a task thread; None without an engine."""
        if self.engine is None or self.loop is None:
            return None
        future = asyncio.run_coroutine_threadsafe(coro_factory(self.engine), self.loop)
        try:
            return future.result(timeout=ENGINE_CALL_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"the engine did not answer within ENGINE_CALL_TIMEOUT={ENGINE_CALL_TIMEOUT:g} s") from None



_lock = threading.Lock()
_context: TaskContext | None = None


def set_context(context: TaskContext | None) -> None:
    global _context
    with _lock:
        _context = context


def get_context() -> TaskContext:
    """The process's context; a worker process builds one from the environment on first use."""
    global _context
    with _lock:
        if _context is None:
            from loraplex.platform.db import make_engine, make_session_factory

            settings = Settings()
            _context = TaskContext(settings, make_session_factory(make_engine(settings.resolved_database_url)))
        return _context
