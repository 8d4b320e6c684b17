"""Everything a request handler needs, built once per app and torn down with it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from loraplex.config import Settings
from loraplex.engine.client import EngineClient
from loraplex.platform.quotas import QuotaLimiter
from loraplex.platform.store_sweep import ContentLeases

log = logging.getLogger(__name__)

@dataclass
class Services:
    settings: Settings
    db: Engine
    sessions: sessionmaker[Session]
    limiter: QuotaLimiter
    engine: EngineClient | None = None
    usage: Any = None  # UsageRecorder
    tasks: Any = None  # TaskDispatcher
    store: Any = None  # AdapterStore
    redis: Any = None  # redis.asyncio.Redis when redis_url is set
    key_use: Any = None  # KeyLastUse: when each API key was last used
    background: list[Any] = field(default_factory=list)  # asyncio tasks to cancel on shutdown
    startup_hooks: list[Any] = field(default_factory=list)  # async (services, app) -> None
    shutdown_hooks: list[Any] = field(default_factory=list)  # async (services) -> None
    owns_engine: bool = False  # started and shut down with the app
    on_request_finished: Any = None  # metrics hook: callable(endpoint, status, tenant, adapter, ...)
    running: dict[str, Any] = field(default_factory=dict)  # request id -> InferenceJob admitted, not settled
    leases: ContentLeases = field(default_factory=ContentLeases)  # adapter content those requests use
    # Unix time this process began serving: the base model's `created` in /v1/models (when it was loaded)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def stop_requests(self) -> int:
        """At shutdown, once the running requests have had their time: end each of them now (a 503, or an
        error event in its stream), settled and journaled as failed on the server's side. Returns how many."""
        jobs = list(self.running.values())
        for job in jobs:
            job.cut()
        return len(jobs)

    async def requests_settled(self, timeout: float) -> bool:
        """Wait (up to `timeout` seconds) until every admitted request has settled its quota and journaled
        its usage; the shutdown closes the journal and Redis only after that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.running and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.running

    @cached_property
    def store_dir(self) -> Path:
        """Absolute: engine processes may run elsewhere than this process's working directory."""
        return self.settings.resolved_adapter_store_dir.resolve()

    @property
    def store_grace_seconds(self) -> float:
        """How long a deleted version's weights stay in the store: with in-process tasks this process is the
        only one that loads them (its leases say when none does); otherwise engine processes elsewhere may
        hold requests for them, which a grace period covers."""
        return 0.0 if self.tasks is not None and self.tasks.eager else self.settings.adapter_store_grace_seconds

    async def sweep_retired(self, content_hashes: list[str] | None = None) -> list[str]:
        """Remove the retired store entries (of these hashes, or all) that are due; never raises."""
        from loraplex.platform.store_sweep import is_retired, sweep

        if content_hashes is not None:
            content_hashes = [h for h in content_hashes if is_retired(self.store_dir, h)]
            if not content_hashes:
                return []
        try:
            return await asyncio.to_thread(sweep, self.sessions, self.store_dir,
                                           grace_seconds=self.store_grace_seconds, leases=self.leases,
                                           only=content_hashes)
        except Exception:
            log.warning("sweeping deleted adapter versions from the store failed; the next sweep retries",
                        exc_info=True)
            return []

    @property
    def base_model_name(self) -> str:
        """What clients put in `model` for the base model: a served name, or the model's short name (a
        local directory is known by its folder name, not its full path)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        name = self.engine.model_name if self.engine is not None else self.settings.model
        return Path(name).name if "/" in name and Path(name).exists() else name

    def engine_problem(self) -> str | None:
        """Why no request could reach an engine now, or None: no engine in this process, or (with
        `serve --no-engine`) no engine process registered."""
        if self.engine is None:
            return "The inference engine is not available in this process."
        failure = getattr(self.engine, "failure", None)
        if failure:
            return f"The inference engine stopped: {failure}."
        if not getattr(self.engine, "available", True):
            return (getattr(self.engine, "unavailable_reason", None)
                    or "No engine process is serving right now; retry shortly.")
        return None

    def require_engine(self) -> EngineClient:
        from loraplex.platform.errors import unavailable

        problem = self.engine_problem()
        if problem is not None:
            raise unavailable(problem, retry_after=2 if self.engine is not None else None)
        return self.engine
