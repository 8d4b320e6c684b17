"""Quotas in Redis: one Lua script checks every limit and increments every counter atomically, so any
number of API processes share one budget without overshooting."""

from __future__ import annotations

from loraplex.platform.quotas.base import (
    WINDOW_SECONDS,
    QuotaLimits,
    Reservation,
    exceeded,
    now_parts,
    rate_headers,
)

# KEYS: requests-window, tokens-window, monthly, in-flight zset
# ARGV: now_ms, rpm, tpm, max_concurrent, monthly_budget, reserve, request_id, inflight_ttl_ms,
#       window_ttl_s, month_ttl_s
_ACQUIRE = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local inflight = redis.call('ZCARD', KEYS[4])
local reqs = tonumber(redis.call('GET', KEYS[1]) or '0')
local toks = tonumber(redis.call('GET', KEYS[2]) or '0')
local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
local reserve = tonumber(ARGV[6])
if inflight >= tonumber(ARGV[4]) then return {1, reqs, toks, spent} end
if reqs + 1 > tonumber(ARGV[2]) then return {2, reqs, toks, spent} end
if toks + reserve > tonumber(ARGV[3]) then return {3, reqs, toks, spent} end
if spent + reserve > tonumber(ARGV[5]) then return {4, reqs, toks, spent} end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[9])
redis.call('INCRBY', KEYS[2], reserve)
redis.call('EXPIRE', KEYS[2], ARGV[9])
redis.call('INCRBY', KEYS[3], reserve)
redis.call('EXPIRE', KEYS[3], ARGV[10])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[8]), ARGV[7])
redis.call('PEXPIRE', KEYS[4], ARGV[8])
return {0, reqs + 1, toks + reserve, spent + reserve}
"""

# KEYS: tokens-window, monthly, in-flight zset. ARGV: delta, request_id.
# Removing the in-flight entry is the once-only guard: a second settle finds nothing and changes nothing.
_SETTLE = """
if redis.call('ZREM', KEYS[3], ARGV[2]) == 0 then return 0 end
local delta = tonumber(ARGV[1])
for i = 1, 2 do
  local cur = redis.call('GET', KEYS[i])
  if cur then
    local v = tonumber(cur) + delta
    if v < 0 then v = 0 end
    redis.call('SET', KEYS[i], v, 'KEEPTTL')
  end
end
return 1
"""

_KINDS = {1: "concurrent", 2: "requests", 3: "tokens", 4: "monthly_budget"}
INFLIGHT_TTL_MS = 10 * 60 * 1000  # a crashed process's in-flight slots free themselves after this


class RedisQuotaLimiter:
    def __init__(self, redis, prefix: str = "lpx"):
        self.redis = redis
        self.prefix = prefix
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)

    def _keys(self, tenant_id: int, minute: int, month: str) -> list[str]:
        base = f"{self.prefix}:rl:{tenant_id}"
        return [f"{base}:req:{minute}", f"{base}:tok:{minute}", f"{base}:month:{month}", f"{base}:inflight"]

    async def acquire(self, tenant_id: int, limits: QuotaLimits, request_id: str,
                      reserve_tokens: int, *, now: float | None = None) -> Reservation:
        t, minute, month = now_parts(now)
        reset_in = (minute + 1) * WINDOW_SECONDS - t
        code, reqs, toks, spent = await self._acquire(
            keys=self._keys(tenant_id, minute, month),
            args=[int(t * 1000), limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent,
                  limits.monthly_token_budget, reserve_tokens, request_id, INFLIGHT_TTL_MS,
                  2 * WINDOW_SECONDS, 40 * 24 * 3600],
        )
        if code:
            raise exceeded(_KINDS[int(code)], limits, int(reqs), int(toks), reset_in, t, reserve_tokens,
                           month_used=int(spent))
        return Reservation(tenant_id, request_id, reserve_tokens, minute, month,
                           headers=rate_headers(limits, int(reqs), int(toks), reset_in))

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        keys = self._keys(reservation.tenant_id, reservation.minute, reservation.month)
        await self._settle(keys=[keys[1], keys[2], keys[3]],
                           args=[used_tokens - reservation.reserved_tokens, reservation.request_id])

    async def close(self) -> None:
        return None
