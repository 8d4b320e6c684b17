"""Quotas in Redis: one Lua script checks every limit and increments every counter atomically, so any
number of API processes share one budget without overshooting."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from loraplex.platform.outage import OutageLog, error_text, every
from loraplex.platform.quotas.base import (
    WINDOW_SECONDS,
    MonthSeed,
    QuotaLimits,
    Reservation,
    exceeded,
    now_parts,
    rate_headers,
)

# KEYS: requests-window, tokens-window, monthly, in-flight zset, reservations hash, held-window (the tokens of
#       the window that running requests reserved and have not settled yet)
# ARGV: now_ms, rpm, tpm, max_concurrent, monthly_budget, reserve, request_id, inflight_ttl_ms,
#       window_ttl_s, month_ttl_s, tenant key base, month, "1" to answer 5 (and count nothing) when the month
#       has no counter yet, so that the caller seeds it first
# An in-flight entry past its expiry belongs to a process that died mid-request (live ones are kept alive by
# their process, `keep_alive`): its slot is freed and its token reservation taken back off its month.
# A request id already in flight was admitted by this very call sent before (the client retries a command
# whose reply a dropped connection lost): it is answered as admitted again, counting nothing twice.
_ACQUIRE = """
local now = tonumber(ARGV[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)) do
  local held = redis.call('HGET', KEYS[5], id)
  if held then
    local amount, month = string.match(held, '^(%d+):(%d+)$')
    if amount then
      local mkey = ARGV[11] .. ':month:' .. month
      local cur = redis.call('GET', mkey)
      if cur then
        local v = tonumber(cur) - tonumber(amount)
        if v < 0 then v = 0 end
        redis.call('SET', mkey, v, 'KEEPTTL')
      end
    end
    redis.call('HDEL', KEYS[5], id)
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local reqs = tonumber(redis.call('GET', KEYS[1]) or '0')
local toks = tonumber(redis.call('GET', KEYS[2]) or '0')
local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
if redis.call('ZSCORE', KEYS[4], ARGV[7]) then return {0, reqs, toks, spent} end
if ARGV[13] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then return {5, 0, 0, 0} end
local inflight = redis.call('ZCARD', KEYS[4])
local reserve = tonumber(ARGV[6])
local held = tonumber(redis.call('GET', KEYS[6]) or '0')
-- never fits, whatever else is in the way (base.never_fits): larger than the per-minute token limit, or than
-- what is left of the month even if running requests used none of their reservations
if reserve > tonumber(ARGV[3]) then return {3, reqs, toks, spent, held} end
if spent + reserve > tonumber(ARGV[5]) then
  local month_held = 0
  for _, value in ipairs(redis.call('HVALS', KEYS[5])) do
    local amount, month = string.match(value, '^(%d+):(%d+)$')
    if amount and month == ARGV[12] then month_held = month_held + tonumber(amount) end
  end
  if spent - month_held + reserve > tonumber(ARGV[5]) then return {4, reqs, toks, spent, held} end
end
if inflight >= tonumber(ARGV[4]) then return {1, reqs, toks, spent, held} end
if reqs + 1 > tonumber(ARGV[2]) then return {2, reqs, toks, spent, held} end
if toks + reserve > tonumber(ARGV[3]) then return {3, reqs, toks, spent, held} end
if spent + reserve > tonumber(ARGV[5]) then return {4, reqs, toks, spent, held} end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[9])
redis.call('INCRBY', KEYS[2], reserve)
redis.call('EXPIRE', KEYS[2], ARGV[9])
redis.call('INCRBY', KEYS[6], reserve)
redis.call('EXPIRE', KEYS[6], ARGV[9])
redis.call('INCRBY', KEYS[3], reserve)
redis.call('EXPIRE', KEYS[3], ARGV[10])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[8]), ARGV[7])
redis.call('EXPIRE', KEYS[4], ARGV[10])
redis.call('HSET', KEYS[5], ARGV[7], reserve .. ':' .. ARGV[12])
redis.call('EXPIRE', KEYS[5], ARGV[10])
return {0, reqs + 1, toks + reserve, spent + reserve}
"""

# KEYS: tokens-window, monthly, in-flight zset, reservations hash, requests-window, held-window.
# ARGV: delta, request_id, reserved, "0" to take the request back off the requests-window.
# Removing the in-flight entry is the once-only guard: a second settle finds nothing and changes nothing.
_SETTLE = """
redis.call('HDEL', KEYS[4], ARGV[2])
if redis.call('ZREM', KEYS[3], ARGV[2]) == 0 then return 0 end
local function add(key, delta)
  local cur = redis.call('GET', key)
  if cur then
    local v = tonumber(cur) + delta
    if v < 0 then v = 0 end
    redis.call('SET', key, v, 'KEEPTTL')
  end
end
local delta = tonumber(ARGV[1])
add(KEYS[1], delta)
add(KEYS[2], delta)
add(KEYS[6], -tonumber(ARGV[3]))
if ARGV[4] == '0' then add(KEYS[5], -1) end
return 1
"""

# KEYS: in-flight zset. ARGV: expiry_ms, request ids: pushes live requests' expiry forward (XX: only those
# still there).
_KEEP_ALIVE = """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i]) end
return 1
"""

# KEYS: in-flight zset, reservations hash, monthly. ARGV: request_id, used tokens, month.
# A request whose process died: its reservation, if it has not lapsed yet (a lapse takes it back off the
# month), is replaced by what it used, and its slot freed; a month with no counter is seeded later from the
# usage records, which hold the request's already.
_SETTLE_INTERRUPTED = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
local cur = redis.call('GET', KEYS[3])
if not cur then return 0 end
local delta = tonumber(ARGV[2])
if held then
  local amount, month = string.match(held, '^(%d+):(%d+)$')
  if amount and month == ARGV[3] then delta = delta - tonumber(amount) end
end
local v = tonumber(cur) + delta
if v < 0 then v = 0 end
redis.call('SET', KEYS[3], v, 'KEEPTTL')
return 1
"""

log = logging.getLogger(__name__)
_KINDS = {1: "concurrent", 2: "requests", 3: "tokens", 4: "monthly_budget"}
# A process keeps its requests' in-flight entries alive every KEEP_ALIVE_SECONDS; a process that dies leaves
# them to lapse after INFLIGHT_TTL_MS, which frees their concurrency slots and takes their reservations back.
INFLIGHT_TTL_MS = 90 * 1000
KEEP_ALIVE_SECONDS = 20.0
# an in-flight entry not pushed forward for this long belongs to a process that stopped (live ones are pushed
# every KEEP_ALIVE_SECONDS; twice that leaves room for a busy event loop)
STALE_AFTER_MS = 2 * KEEP_ALIVE_SECONDS * 1000
SETTLE_SECONDS = 2.0  # a settlement Redis does not answer in time is retried by the keep-alive loop
MAX_REQUEST_SECONDS = 6 * 3600  # no request runs this long: one still unsettled is kept alive no more
MONTH_TTL_SECONDS = 40 * 24 * 3600


class RedisQuotaLimiter:
    def __init__(self, redis, prefix: str = "lpx", month_seed: MonthSeed | None = None):
        self.redis = redis
        self.prefix = prefix
        self.month_seed = month_seed
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self._keep_alive = redis.register_script(_KEEP_ALIVE)
        self._settle_interrupted = redis.register_script(_SETTLE_INTERRUPTED)
        # this process's unsettled reservations -> when they were made (time.monotonic())
        self._live: dict[tuple[int, str], float] = {}
        # settlements Redis did not take: (keys, args, when) retried until they land or their entry lapses
        self._unsettled: list[tuple[list[str], list, float]] = []

    def _base(self, tenant_id: int) -> str:
        return f"{self.prefix}:rl:{tenant_id}"

    def _keys(self, tenant_id: int, minute: int, month: str) -> list[str]:
        base = self._base(tenant_id)
        return [f"{base}:req:{minute}", f"{base}:tok:{minute}", f"{base}:month:{month}", f"{base}:inflight",
                f"{base}:reserved", f"{base}:held:{minute}"]

    async def acquire(self, tenant_id: int, limits: QuotaLimits, request_id: str,
                      reserve_tokens: int, *, now: float | None = None) -> Reservation:
        t, minute, month = now_parts(now)
        reset_in = (minute + 1) * WINDOW_SECONDS - t
        # A month with no counter (its first request, or a Redis that lost its data, whenever that happened)
        # is seeded from the usage records first; the script says so without counting anything.
        seed = self.month_seed is not None
        while True:
            code, reqs, toks, spent, *held_in_window = await self._acquire(
                keys=self._keys(tenant_id, minute, month),
                args=[int(t * 1000), limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent,
                      limits.monthly_token_budget, reserve_tokens, request_id, INFLIGHT_TTL_MS,
                      2 * WINDOW_SECONDS, MONTH_TTL_SECONDS, self._base(tenant_id), month, "1" if seed else "0"],
            )
            if int(code) != 5:
                break
            await self._seed(tenant_id, month)
            seed = False  # seeded, or the records could not be read: count from here either way
        if code:
            kind = _KINDS[int(code)]
            held = 0
            if kind == "monthly_budget":  # how much of it running requests only reserve
                for value in await self.redis.hvals(self._keys(tenant_id, minute, month)[4]):
                    text = value.decode() if isinstance(value, bytes) else str(value)
                    reserved, _, of_month = text.partition(":")
                    if of_month == month and reserved.lstrip("-").isdigit():
                        held += int(reserved)
            slots_free_in = await self._slots_free_in(tenant_id, t) if kind == "concurrent" else None
            raise exceeded(kind, limits, int(reqs), int(toks), reset_in, t, reserve_tokens,
                           month_used=int(spent), month_in_flight=held,
                           window_in_flight=int(held_in_window[0]) if held_in_window else 0,
                           slots_free_in=slots_free_in)
        reservation = Reservation(tenant_id, request_id, reserve_tokens, minute, month,
                                  headers=rate_headers(limits, int(reqs), int(toks), reset_in))
        self._live[(tenant_id, request_id)] = time.monotonic()
        return reservation

    async def _slots_free_in(self, tenant_id: int, now: float) -> float | None:
        """Seconds until the first of the tenant's concurrency slots lapses, when every one is held by a
        request that nobody keeps alive (its API process stopped mid-request); None when some are live: those
        end when their requests do, any moment."""
        entries = await self.redis.zrange(f"{self._base(tenant_id)}:inflight", 0, -1, withscores=True)
        now_ms = now * 1000
        left = [expiry - now_ms for _, expiry in entries]
        if not left or any(ms > INFLIGHT_TTL_MS - STALE_AFTER_MS for ms in left):
            return None
        return max(1.0, math.ceil(min(left) / 1000))

    def _month_key(self, tenant_id: int, month: str) -> str:
        return f"{self._base(tenant_id)}:month:{month}"

    async def _seed(self, tenant_id: int, month: str) -> None:
        """A month with no counter in Redis starts from the tenant's usage records; SET NX keeps the counter
        another process made first."""
        if self.month_seed is None:
            return
        try:
            used = await self.month_seed(tenant_id, month)
            await self.redis.set(self._month_key(tenant_id, month), used, nx=True, ex=MONTH_TTL_SECONDS)
        except Exception:
            log.warning("could not seed tenant %s's monthly counter for %s", tenant_id, month, exc_info=True)

    async def month_used(self, tenant_id: int, *, now: float | None = None) -> int:
        return (await self.used_now(tenant_id, now=now))[1]

    async def used_now(self, tenant_id: int, *, now: float | None = None) -> tuple[int, int]:
        _, minute, month = now_parts(now)
        keys = self._keys(tenant_id, minute, month)
        window, spent = await self.redis.mget(keys[1], keys[2])
        if spent is None:
            await self._seed(tenant_id, month)
            spent = await self.redis.get(keys[2])
        return int(window or 0), int(spent or 0)

    async def keep_alive(self, *, now: float | None = None) -> int:
        """Settle what Redis did not take before, and push this process's unsettled reservations' expiry
        forward; returns how many of those."""
        await self._retry_settlements()
        t = now_parts(now)[0]
        by_tenant: dict[int, list[str]] = {}
        oldest = time.monotonic() - MAX_REQUEST_SECONDS
        for (tenant_id, request_id), made in list(self._live.items()):
            if made < oldest:  # never settled (a request path that lost it): let its entry lapse
                self._live.pop((tenant_id, request_id), None)
                continue
            by_tenant.setdefault(tenant_id, []).append(request_id)
        for tenant_id, ids in by_tenant.items():
            await self._keep_alive(keys=[f"{self._base(tenant_id)}:inflight"],
                                   args=[int(t * 1000) + INFLIGHT_TTL_MS, *ids])
        return sum(len(ids) for ids in by_tenant.values())

    async def run(self) -> None:
        """The keep-alive loop (a background task of the API process)."""
        await every(KEEP_ALIVE_SECONDS, self.keep_alive,
                    OutageLog(log, "keeping in-flight quota entries alive", KEEP_ALIVE_SECONDS))

    async def settle(self, reservation: Reservation, used_tokens: int, *, count_request: bool = True) -> None:
        """Never raises for Redis's sake: a settlement Redis does not take in SETTLE_SECONDS is retried
        with the keep-alive (the script's once-only guard makes a retry of one that did land harmless), so
        an outage of seconds neither loses the request's count nor holds its slot until the entry lapses."""
        if reservation.settled:
            return
        reservation.settled = True
        self._live.pop((reservation.tenant_id, reservation.request_id), None)
        req, tok, month, inflight, reserved, held = self._keys(reservation.tenant_id, reservation.minute,
                                                               reservation.month)
        keys = [tok, month, inflight, reserved, req, held]
        args = [used_tokens - reservation.reserved_tokens, reservation.request_id, reservation.reserved_tokens,
                "1" if count_request else "0"]
        try:
            await asyncio.wait_for(self._settle(keys=keys, args=args), SETTLE_SECONDS)
        except Exception as exc:  # noqa: BLE001 - Redis away or slow: retried below, never the request's error
            why = (f"no answer within SETTLE_SECONDS={SETTLE_SECONDS:g} s" if type(exc) is TimeoutError
                   else error_text(exc))
            log.warning("settling request %s's quota failed (%s); retried every %s s until Redis takes it",
                        reservation.request_id, why, KEEP_ALIVE_SECONDS)
            self._unsettled.append((keys, args, time.monotonic()))

    async def settle_interrupted(self, tenant_id: int, request_id: str, month: str, used_tokens: int) -> None:
        base = self._base(tenant_id)
        await self._settle_interrupted(keys=[f"{base}:inflight", f"{base}:reserved", self._month_key(tenant_id, month)],
                                       args=[request_id, used_tokens, month])

    async def _retry_settlements(self) -> None:
        lapsed = time.monotonic() - INFLIGHT_TTL_MS / 1000  # their entries are gone: nothing left to settle
        self._unsettled = [u for u in self._unsettled if u[2] >= lapsed]
        while self._unsettled:
            keys, args, _ = self._unsettled[0]
            await self._settle(keys=keys, args=args)  # raises while Redis is still away: the outage log says so
            self._unsettled.pop(0)

    async def close(self) -> None:
        return None
