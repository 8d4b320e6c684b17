"""The production journal: a Redis list every API process appends to before it responds.

One flusher at a time (a Redis lock with a token) reads a batch from the head, inserts it, and trims the
list only while it still holds the lock; a flusher that dies after inserting leaves the batch in place and
the next one re-inserts it, which the request-id key makes harmless. A lock whose holder died lapses after
`lock_ms`, and the next flush (within the flush interval) takes it.

Every step may reach Redis twice (the client sends a command again when a dropped connection lost its reply):
a record appended twice is one row, the lock taken "again" is found to be ours by its token, a trim or a
release runs only while the token still holds the lock, so none of them acts twice.
"""

from __future__ import annotations

import uuid

from loraplex.platform.usage.event import UsageEvent

_TRIM_IF_OWNER = """
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('LTRIM', KEYS[1], tonumber(ARGV[2]), -1)
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"""

_RELEASE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisJournal:
    def __init__(self, redis, prefix: str, lock_ms: int = 60_000):
        self.redis = redis
        self.key = f"{prefix}:usage:journal"
        self.lock_key = f"{prefix}:usage:flush-lock"
        self.lock_ms = lock_ms
        self._trim = redis.register_script(_TRIM_IF_OWNER)
        self._release = redis.register_script(_RELEASE_IF_OWNER)

    async def append(self, event: UsageEvent) -> None:
        await self.redis.rpush(self.key, event.to_json())

    async def take(self, batch_size: int) -> tuple[str, list[UsageEvent]] | None:
        token = uuid.uuid4().hex
        if not await self.redis.set(self.lock_key, token, nx=True, px=self.lock_ms):
            # held by another flusher, or by this one: a SET sent again after its reply was lost finds the
            # key it made
            if await self.redis.get(self.lock_key) not in (token, token.encode()):
                return None
        raw = await self.redis.lrange(self.key, 0, batch_size - 1)
        events = []
        for item in raw:
            try:
                events.append(UsageEvent.from_json(item))
            except (ValueError, TypeError):
                continue
        return token + f":{len(raw)}", events

    async def ack(self, receipt: str) -> bool:
        token, count = receipt.rsplit(":", 1)
        return bool(await self._trim(keys=[self.key, self.lock_key], args=[token, int(count)]))

    async def release(self, receipt: str) -> None:
        token = receipt.rsplit(":", 1)[0]
        # one step: a lock that lapsed and was taken by another flusher meanwhile stays theirs
        await self._release(keys=[self.lock_key], args=[token])

    async def pending(self) -> int:
        return await self.redis.llen(self.key)
