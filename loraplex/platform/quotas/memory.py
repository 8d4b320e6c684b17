"""The in-process limiter for the embedded default (one API process, so a lock is atomic enough)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from loraplex.platform.quotas.base import (
    WINDOW_SECONDS,
    MonthSeed,
    QuotaLimits,
    Reservation,
    exceeded,
    never_fits,
    now_parts,
    rate_headers,
)

INFLIGHT_TTL_SECONDS = 600
log = logging.getLogger(__name__)


class MemoryQuotaLimiter:
    def __init__(self, clock=None, month_seed: MonthSeed | None = None) -> None:
        self._clock = clock  # a fixed clock lets tests pin every request into one window
        self.month_seed = month_seed
        self._seeded: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        self._requests: dict[tuple[int, int], int] = defaultdict(int)  # (tenant, minute) -> count
        self._tokens: dict[tuple[int, int], int] = defaultdict(int)
        self._monthly: dict[tuple[int, str], int] = defaultdict(int)
        # tenant -> request id -> when acquired; entries a lost request never settled expire like Redis's
        self._inflight: dict[int, dict[str, float]] = defaultdict(dict)
        # tenant -> request id -> (tokens reserved, month, minute) until settled
        self._held: dict[int, dict[str, tuple[int, str, int]]] = defaultdict(dict)

    async def acquire(self, tenant_id: int, limits: QuotaLimits, request_id: str,
                      reserve_tokens: int, *, now: float | None = None) -> Reservation:
        if now is None and self._clock is not None:
            now = self._clock()
        t, minute, month = now_parts(now)
        reset_in = (minute + 1) * WINDOW_SECONDS - t
        await self._seed(tenant_id, month)
        with self._lock:
            self._forget_old_windows(minute)
            reqs = self._requests[(tenant_id, minute)]
            toks = self._tokens[(tenant_id, minute)]
            spent = self._monthly[(tenant_id, month)]
            inflight = self._inflight[tenant_id]
            for stale in [r for r, at in inflight.items() if at < t - INFLIGHT_TTL_SECONDS]:
                del inflight[stale]
                self._held[tenant_id].pop(stale, None)
            held = self._held[tenant_id].values()
            month_in_flight = sum(r for r, m, _ in held if m == month)
            kind = never_fits(limits, reserve_tokens, spent, month_in_flight)
            if kind is None:
                if len(inflight) >= limits.max_concurrent:
                    kind = "concurrent"
                elif reqs + 1 > limits.requests_per_minute:
                    kind = "requests"
                elif toks + reserve_tokens > limits.tokens_per_minute:
                    kind = "tokens"
                elif spent + reserve_tokens > limits.monthly_token_budget:
                    kind = "monthly_budget"
            if kind is not None:
                raise exceeded(kind, limits, reqs, toks, reset_in, t, reserve_tokens, month_used=spent,
                               month_in_flight=month_in_flight,
                               window_in_flight=sum(r for r, _, w in held if w == minute))
            self._requests[(tenant_id, minute)] = reqs + 1
            self._tokens[(tenant_id, minute)] = toks + reserve_tokens
            self._monthly[(tenant_id, month)] = spent + reserve_tokens
            inflight[request_id] = t
            self._held[tenant_id][request_id] = (reserve_tokens, month, minute)
        return Reservation(tenant_id, request_id, reserve_tokens, minute, month,
                           headers=rate_headers(limits, reqs + 1, toks + reserve_tokens, reset_in))

    async def _seed(self, tenant_id: int, month: str) -> None:
        """This process's first count of a tenant's month starts from its usage records (a restart)."""
        key = (tenant_id, month)
        if self.month_seed is None or key in self._seeded:
            return
        try:
            used = await self.month_seed(tenant_id, month)
        except Exception:
            log.warning("could not count tenant %s's usage for %s; its monthly budget counts from 0 until it "
                        "can", tenant_id, month, exc_info=True)
            return
        with self._lock:
            if key not in self._seeded:
                self._seeded.add(key)
                self._monthly[key] += used

    async def month_used(self, tenant_id: int, *, now: float | None = None) -> int:
        return (await self.used_now(tenant_id, now=now))[1]

    async def used_now(self, tenant_id: int, *, now: float | None = None) -> tuple[int, int]:
        if now is None and self._clock is not None:
            now = self._clock()
        _, minute, month = now_parts(now)
        await self._seed(tenant_id, month)
        with self._lock:
            return self._tokens.get((tenant_id, minute), 0), self._monthly.get((tenant_id, month), 0)

    async def settle(self, reservation: Reservation, used_tokens: int, *, count_request: bool = True) -> None:
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            delta = used_tokens - reservation.reserved_tokens
            key = (reservation.tenant_id, reservation.minute)
            if key in self._tokens:
                self._tokens[key] = max(0, self._tokens[key] + delta)
            if not count_request and key in self._requests:
                self._requests[key] = max(0, self._requests[key] - 1)
            mkey = (reservation.tenant_id, reservation.month)
            self._monthly[mkey] = max(0, self._monthly[mkey] + delta)
            self._inflight[reservation.tenant_id].pop(reservation.request_id, None)
            self._held[reservation.tenant_id].pop(reservation.request_id, None)

    async def settle_interrupted(self, tenant_id: int, request_id: str, month: str, used_tokens: int) -> None:
        """The reservation died with its process (this limiter lives in one): only the month counts the tokens,
        and only once it is counted here; an unseeded month is seeded from the usage records, which already
        hold the request's."""
        with self._lock:
            if (tenant_id, month) in self._seeded or self.month_seed is None:
                self._monthly[(tenant_id, month)] += used_tokens

    async def close(self) -> None:
        return None

    def _forget_old_windows(self, minute: int) -> None:
        for table in (self._requests, self._tokens):
            for key in [k for k in table if k[1] < minute - 1]:
                del table[key]
