"""UsageRecorder: `record()` on the request path (a journal append), `flush()` in the background.

With the Redis journal, a record Redis does not take (an outage, a restart) goes to a local spool, a file
journal in the data directory, which every flush moves into the database as it moves Redis's: a request
that finished is never turned into an error by its record, nor left unbilled.

With an in-flight ledger, each flush also settles the requests a dead process left running (see
usage/inflight.py), after the journals: a request that finished but whose ledger line says otherwise (killed
between the two writes) keeps its own record, the interrupted one finds its request id taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.outage import OutageLog, error_text, every
from loraplex.platform.usage.event import UsageEvent
from loraplex.platform.usage.file_journal import FileJournal
from loraplex.platform.usage.inflight import InflightLedger, Interrupted
from loraplex.platform.usage.redis_journal import RedisJournal
from loraplex.platform.usage.sink import insert_events

log = logging.getLogger(__name__)
# how long a record may try the Redis journal (the client's own retries included) before it is spooled: the
# request's response waits for it
APPEND_SECONDS = 2.0
RETRY_DELAYS = (0.05, 0.2, 0.5)


class UsageRecorder:
    def __init__(self, sessions: sessionmaker[Session], journal: FileJournal | RedisJournal, *,
                 spool: FileJournal | None = None, batch_size: int = 500, interval: float = 1.0,
                 append_seconds: float = APPEND_SECONDS, ledger: InflightLedger | None = None,
                 on_interrupted: Callable[[Interrupted], Awaitable[None]] | None = None):
        """spool: where records go that the Redis journal does not take (None: nowhere but the log).
        ledger: this process's in-flight ledger, and where dead processes' ledgers are found.
        on_interrupted: called once for each interrupted request whose record was new (the quota's side)."""
        self.sessions = sessions
        self.journal = journal
        self.spool = spool
        self.batch_size = batch_size
        self.interval = interval
        self.append_seconds = append_seconds
        self.ledger = ledger
        self.on_interrupted = on_interrupted
        self._flush_lock = asyncio.Lock()
        self._batch: asyncio.Future | None = None  # the Redis batch being moved (see _flush_redis)
        self._spooling = False  # records are going to the spool (logged once per outage)

    async def record(self, event: UsageEvent) -> None:
        """Journal the record; never raises: the request it records has finished whatever happens here."""
        if not isinstance(self.journal, RedisJournal):
            self.journal.append(event)
            return
        error = await self._append_redis(event)
        if error is None:
            if self._spooling:
                log.warning("the Redis usage journal takes records again")
                self._spooling = False
            return
        if not self._spooling:
            why = (f"no answer within APPEND_SECONDS={self.append_seconds:g} s" if type(error) is TimeoutError
                   else error_text(error))
            log.warning("the Redis usage journal did not take request %s's record (%s); records go to the "
                        "local spool until it does, and from there to the database", event.request_id, why)
            self._spooling = True
        try:
            if self.spool is None:
                raise RuntimeError("no spool")
            self.spool.append(event)
        except Exception:
            # the last place the record can still be found: the log, whole
            log.exception("usage record of request %s could be neither journaled nor spooled: %s",
                          event.request_id, event.to_json())

    async def _append_redis(self, event: UsageEvent) -> BaseException | None:
        """Append to the Redis journal, retrying for up to append_seconds; the error that won, or None.
        An append cut by the deadline may still have reached Redis: the record is then both there and in
        the spool, and the request id keeps it one row."""
        deadline = time.monotonic() + self.append_seconds
        delays = iter(RETRY_DELAYS)
        while True:
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self.journal.append(event), timeout=max(left, 0.001))
                return None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever Redis says, the record must land somewhere
                error = exc
            delay = next(delays, None)
            if delay is None or time.monotonic() + delay >= deadline:
                return error
            await asyncio.sleep(delay)

    async def flush(self) -> int:
        """Move journaled events into the database; returns how many rows were new."""
        async with self._flush_lock:
            if self.ledger is not None:
                await asyncio.to_thread(self.ledger.sync)
            if not isinstance(self.journal, RedisJournal):
                inserted = await self._flush_files(self.journal)
            else:
                # the spool first: it needs only the database, which may answer while Redis does not
                inserted = await self._flush_files(self.spool) if self.spool is not None else 0
                inserted += await self._flush_redis()
            return inserted + await self._settle_interrupted()

    async def _settle_interrupted(self) -> int:
        """Requests that dead processes' ledgers leave open, recorded from their last checkpoint as
        "interrupted"; one at a time, so that only a record that is new counts against the quota."""
        if self.ledger is None:
            return 0
        inserted = 0
        for path, fd, requests in await asyncio.to_thread(self.ledger.orphaned):
            try:
                for request in requests:
                    if not await asyncio.to_thread(insert_events, self.sessions, [request.event]):
                        continue  # recorded already: it finished after all, or an earlier recovery took it
                    inserted += 1
                    event = request.event
                    log.warning("request %s (tenant %s) was cut off by the end of its server process; recorded "
                                "as interrupted with the %d prompt and %d completion tokens of its last "
                                "checkpoint", event.request_id, event.tenant_id, event.prompt_tokens,
                                event.completion_tokens)
                    if self.on_interrupted is not None:
                        try:
                            await self.on_interrupted(request)
                        except Exception:
                            log.exception("counting interrupted request %s against its quota failed",
                                          event.request_id)
            except BaseException:
                self.ledger.release(fd)
                raise
            self.ledger.done(path, fd)
        return inserted

    async def _flush_files(self, journal: FileJournal) -> int:
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
            # a flush cancelled meanwhile no longer awaits it: its error (Redis away; the journal keeps the batch)
            # is taken here rather than reported as never retrieved
            self._batch.add_done_callback(lambda batch: batch.cancelled() or batch.exception())
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
        try:
            await journal.ack(receipt)
        except BaseException:
            # the batch stays in the journal (re-inserted, harmlessly, by the next flush); the lock is given back
            # now where Redis answers, rather than held until it lapses
            with contextlib.suppress(Exception):
                await journal.release(receipt)
            raise
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
            for journal in (self.journal, self.spool):
                if isinstance(journal, FileJournal):
                    journal.close()
            if self.ledger is not None:
                self.ledger.close_file()
