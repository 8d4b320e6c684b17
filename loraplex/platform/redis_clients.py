"""Every Redis client of the service, built one way.

A connect that hangs or a reply that never comes fails within its timeout instead of holding a request for
ever; a connection Redis dropped (a restart, a failover, an idle proxy) is found by the health check or the
first command on it and replaced, and a command cut by ConnectionError or TimeoutError is sent again with
exponential backoff (with jitter, so N processes do not reconnect in step). A restart of a few seconds thus
costs requests a short wait rather than a 503 each. The async clients (the API's, the engine registry's) also
bound each command as a whole by `redis_deadline`: a Redis that accepts connections but never answers would
otherwise hold a request for its retries times the socket timeout (half a minute and more) before its 503.

A retried command may have run once already (the reply was lost): every script and write of the service is
written to be harmless run twice (quotas by request id, the usage journal by request id, locks by token).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from loraplex.config import Settings

# seconds an idle pooled connection may sit before its next use checks it with a PING first
HEALTH_CHECK_SECONDS = 15
BACKOFF_BASE_SECONDS = 0.05
BACKOFF_CAP_SECONDS = 2.0

# what each timeout of a Redis client is called where an operator sets it
CONNECT_TIMEOUT_SETTING = "LORAPLEX_REDIS_CONNECT_TIMEOUT"
SOCKET_TIMEOUT_SETTING = "LORAPLEX_REDIS_SOCKET_TIMEOUT"
DEADLINE_SETTING = "LORAPLEX_REDIS_DEADLINE"
# the timeouts this process's clients were last built with, for the logs that report one
_timeouts: dict[str, float] = {}


def _options(settings: Settings, retry_cls, *, retries: int | None) -> dict[str, Any]:
    from redis.backoff import EqualJitterBackoff
    from redis.exceptions import ConnectionError, TimeoutError

    errors = (ConnectionError, TimeoutError)
    count = settings.redis_retries if retries is None else retries
    _timeouts.update(connect=settings.redis_connect_timeout, socket=settings.redis_socket_timeout)
    return {
        "socket_connect_timeout": settings.redis_connect_timeout,
        "socket_timeout": settings.redis_socket_timeout,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_SECONDS,
        "retry": retry_cls(EqualJitterBackoff(cap=BACKOFF_CAP_SECONDS, base=BACKOFF_BASE_SECONDS), count,
                           supported_errors=errors),
        "retry_on_error": list(errors),
    }


@functools.cache
def _deadline_client_class():
    import redis.asyncio as aioredis
    from redis.exceptions import TimeoutError as RedisTimeout

    class DeadlineRedis(aioredis.Redis):
        """A client whose every command (its connect, its retries and their backoff included) ends within
        `deadline` seconds, as a redis TimeoutError (which the API answers with a 503)."""

        deadline: float | None = None

        async def execute_command(self, *args, **options):
            if self.deadline is None:
                return await super().execute_command(*args, **options)
            scope = asyncio.timeout(self.deadline)
            try:
                async with scope:
                    # cut mid-reply, the connection is closed by the client (never reused with a reply pending)
                    return await super().execute_command(*args, **options)
            except TimeoutError:
                if not scope.expired():
                    raise
                raise RedisTimeout(f"Redis did not answer {args[0]!s} within {DEADLINE_SETTING}="
                                   f"{self.deadline:g} s (retries included)") from None

    return DeadlineRedis


def async_redis(settings: Settings, *, url: str | None = None, retries: int | None = None):
    """A redis.asyncio client for `url` (default: settings.redis_url); options in the URL's query win. Each
    command ends within settings.redis_deadline seconds, retries included."""
    from redis.asyncio.retry import Retry

    client = _deadline_client_class().from_url(url or settings.redis_url,
                                               **_options(settings, Retry, retries=retries))
    client.deadline = settings.redis_deadline
    _timeouts["deadline"] = settings.redis_deadline
    return client


def sync_redis(settings: Settings, *, url: str | None = None, retries: int | None = None):
    """A blocking redis client (threads: the scheduler's lease, command-line probes)."""
    import redis
    from redis.retry import Retry

    return redis.Redis.from_url(url or settings.redis_url, **_options(settings, Retry, retries=retries))


def describe_timeout(exc: BaseException) -> str | None:
    """For a Redis client's timeout, which of its timeouts it was (the setting and its value); else None."""
    try:
        from redis.exceptions import TimeoutError as RedisTimeout
    except ImportError:  # pragma: no cover - redis is a dependency
        return None
    if not isinstance(exc, RedisTimeout):
        return None
    defaults = Settings.model_fields
    if DEADLINE_SETTING in str(exc):
        value = _timeouts.get("deadline", defaults["redis_deadline"].default)
        return f"Redis deadline {DEADLINE_SETTING}={value:g} s"
    if "connecting" in str(exc):
        value = _timeouts.get("connect", defaults["redis_connect_timeout"].default)
        return f"Redis connect timeout {CONNECT_TIMEOUT_SETTING}={value:g} s"
    value = _timeouts.get("socket", defaults["redis_socket_timeout"].default)
    return f"Redis socket timeout {SOCKET_TIMEOUT_SETTING}={value:g} s"
