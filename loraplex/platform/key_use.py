"""When each API key was last used, written at most once a minute per key and off the request path.

A request only notes its key in a dict; a background loop writes what was noted since its last round in
one UPDATE per key (never moving a time backwards, as another API process may have written a later one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import UTC, datetime

from sqlalchemy import or_, update
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.models import ApiKey
from loraplex.platform.outage import OutageLog, every

log = logging.getLogger(__name__)
WRITE_SECONDS = 60.0


class KeyLastUse:
    def __init__(self, sessions: sessionmaker[Session], interval: float = WRITE_SECONDS):
        self.sessions = sessions
        self.interval = interval
        self._lock = threading.Lock()  # requests note on the event loop, the writer runs in a thread
        self._seen: dict[int, float] = {}  # key id -> its latest use not yet written (Unix time)

    def touch(self, key_id: int) -> None:
        with self._lock:
            self._seen[key_id] = time.time()

    def write(self) -> int:
        """Write the noted uses; returns how many keys. What fails to be written is noted again."""
        with self._lock:
            seen, self._seen = self._seen, {}
        if not seen:
            return 0
        try:
            with self.sessions() as session:
                for key_id, unix in seen.items():
                    at = datetime.fromtimestamp(unix, UTC)
                    session.execute(update(ApiKey).where(
                        ApiKey.id == key_id, or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < at))
                        .values(last_used_at=at))
                session.commit()
        except BaseException:
            with self._lock:
                for key_id, unix in seen.items():  # a later use noted meanwhile wins
                    self._seen.setdefault(key_id, unix)
            raise
        return len(seen)

    async def run(self) -> None:
        await every(self.interval, lambda: asyncio.to_thread(self.write),
                    OutageLog(log, "recording when API keys were last used", self.interval))

    async def close(self) -> None:
        try:
            await asyncio.to_thread(self.write)
        except Exception:
            log.warning("could not record when API keys were last used", exc_info=True)
