"""UsageRecorder: `record()` on the request path (a journal append), `flush()` in the background."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.outage import OutageLog, every
from loraplex.platform.usage.event import UsageEvent
from loraplex.platform.usage.file_journal import FileJournal
from loraplex.platform.usage.redis_journal import RedisJournal
from loraplex.platform.usage.sink import insert_events

log = logging.getLogger(__name__)


class UsageRecorder:
    def __init__(self, sessions: sessionmaker[Session], journal: FileJournal | RedisJournal, *,
                 batch_size: int = 500, interval: float = 1.0):
        self.sessions = sessions
        self.journal = journal
        self.batch_size = batch_size
        self.interval = interval
        self._flush_lock = asyncio.Lock()
        self._batch: asyncio.Future | None = None  # the Redis batch being moved (see _flush_redis)

    async def record(self, event: UsageEvent) -> None:
        if isinstance(self.journal, RedisJournal):
            await self.journal.append(event)
        else:
            self.journal.append(event)

    async def flush(self) -> int:
        """Move journaled events into the database; returns how many rows were new."""
        async with self._flush_lock:
            if isinstance(self.journal, RedisJournal):
                return await self._flush_redis()
            return await self._flush_files()

    async def _flush_files(self) -> int:
        journal: FileJournal = self.journal
        journal.seal()
        inserted = 0
        for path, fd, events in await asyncio.to_thread(journal.replayable):
            try:
                for start in range(0, len(events), self.batch_size):
                    inserted += await asyncio.to_thread(insert_events, self.sessions,
                                                        events[start:start + self.batch_size])
            except BaseException:
                journal.release(fd)
                raise
            journal.done(path, fd)
        return inserted

    async def _flush_redis(self) -> int:
        inserted = 0
        while True:
            # a batch runs to its ack or release even when the flush is cancelled (the background loop at
            # shutdown): cut between the two it would leave the journal's lock held for its whole expiry,
            # and every process's flushes waiting on it
            self._batch = asyncio.ensure_future(self._flush_redis_batch())
            count, more = await asyncio.shield(self._batch)
            inserted += count
            if not more:
                return inserted

    async def _flush_redis_batch(self) -> tuple[int, bool]:
        journal: RedisJournal = self.journal
        taken = await journal.take(self.batch_size)
        if taken is None:
            return 0, False  # another process is flushing
        receipt, events = taken
        try:
            inserted = await asyncio.to_thread(insert_events, self.sessions, events)
        except BaseException:
            await journal.release(receipt)
            raise
        await journal.ack(receipt)
        return inserted, len(events) >= self.batch_size

    async def run(self) -> None:
        """The background loop; errors are logged and retried, never lost (the journal keeps them)."""
        await every(self.interval, self.flush,
                    OutageLog(log, "usage flush", self.interval, " (the journal keeps the records)"))

    async def close(self) -> None:
        if self._batch is not None and not self._batch.done():  # a cancelled flush's batch, still finishing
            await asyncio.wait([self._batch])
        try:
            await self.flush()
        finally:
            if isinstance(self.journal, FileJournal):
                self.journal.close()
