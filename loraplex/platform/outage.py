"""One log line when a background loop's work starts failing (Redis or the database away) and one when it
works again, rather than a traceback at every retry; the tracebacks stay at DEBUG."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str, retry_seconds: float, consequence: str = ""):
        self.logger = logger
        self.what = what  # "reading the engine registry"
        self.retry_seconds = retry_seconds
        self.consequence = consequence  # ", API processes cannot find this engine until it is restored"
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self.logger.warning("%s failed%s (retrying every %s s): %s", self.what, self.consequence,
                                self.retry_seconds, error_text(exc))
            self.failing = True
        self.logger.debug("%s failed", self.what, exc_info=exc)

    def ok(self) -> None:
        if self.failing:
            self.logger.warning("%s restored", self.what)
            self.failing = False


def error_text(exc: BaseException) -> str:
    """An error for a log line, never empty; a timeout names which one it was (its setting and value)."""
    from loraplex.platform.redis_clients import describe_timeout

    text = str(exc) or type(exc).__name__
    which = describe_timeout(exc)
    return f"{text} ({which})" if which else text


async def every(seconds: float, work: Callable[[], Awaitable[object]], outage: OutageLog, *,
                at_start: bool = False) -> None:
    """`await work()` every `seconds` (and once right away with `at_start`), for ever (cancel the task to
    stop); failures go to `outage`."""
    first = at_start
    while True:
        if not first:
            await asyncio.sleep(seconds)
        first = False
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outage.failed(exc)
        else:
            outage.ok()
