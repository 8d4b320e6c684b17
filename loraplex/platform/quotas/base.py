"""The limiter contract shared by the in-process and the Redis implementations."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

WINDOW_SECONDS = 60


@dataclass(frozen=True)
class QuotaLimits:
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    monthly_token_budget: int


@dataclass
class Reservation:
    """What acquire() took, so settle() can give back the difference exactly once."""

    tenant_id: int
    request_id: str
    reserved_tokens: int
    minute: int  # window index the tokens were counted in
    month: str  # YYYYMM of the monthly budget counted
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


class QuotaExceeded(Exception):
    def __init__(self, message: str, *, kind: str, retry_after: float, headers: dict[str, str]):
        super().__init__(message)
        self.message = message
        self.kind = kind  # requests | tokens | concurrent | monthly_budget
        self.retry_after = retry_after
        self.headers = headers


# (tenant id, YYYYMM) -> the tokens the tenant's usage records count in that month: where a limiter's monthly
# counter starts when it has none (a restarted embedded server, an emptied Redis), so a restart does not hand
# a tenant its monthly budget again
MonthSeed = Callable[[int, str], Awaitable[int]]


class QuotaLimiter(Protocol):
    month_seed: MonthSeed | None

    async def acquire(self, tenant_id: int, limits: QuotaLimits, request_id: str,
                      reserve_tokens: int) -> Reservation: ...

    async def month_used(self, tenant_id: int) -> int:
        """Tokens counted against the tenant's monthly budget so far this month."""
        ...

    async def used_now(self, tenant_id: int) -> tuple[int, int]:
        """Tokens counted against the tenant's per-minute limit in the current window, and against its
        monthly budget this month (reservations of requests still running included)."""
        ...

    async def settle(self, reservation: Reservation, used_tokens: int, *, count_request: bool = True) -> None:
        """Count what the request used instead of what it reserved, and free its concurrency slot.
        count_request=False: the request did not happen at all (the engine refused it before doing any
        work), so it gives back its place in the per-minute request count too."""
        ...

    async def settle_interrupted(self, tenant_id: int, request_id: str, month: str, used_tokens: int) -> None:
        """Settle, from another process, a request whose own process died before it settled: its
        reservation (if it has not lapsed yet) is replaced by `used_tokens`, its concurrency slot freed. Called
        once per request (when its interrupted usage record is new)."""
        ...

    async def close(self) -> None: ...


def now_parts(now: float | None = None) -> tuple[float, int, str]:
    t = time.time() if now is None else now
    return t, int(t // WINDOW_SECONDS), datetime.fromtimestamp(t, UTC).strftime("%Y%m")


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '20ms'."""
    if seconds < 1:
        return f"{max(1, int(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rate_headers(limits: QuotaLimits, used_requests: int, used_tokens: int, reset_in: float) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(limits.requests_per_minute),
        "x-ratelimit-remaining-requests": str(max(0, limits.requests_per_minute - used_requests)),
        "x-ratelimit-reset-requests": format_reset(reset_in),
        "x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
        "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - used_tokens)),
        "x-ratelimit-reset-tokens": format_reset(reset_in),
    }


def seconds_to_next_month(now: float) -> float:
    d = datetime.fromtimestamp(now, UTC)
    nxt = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    return nxt.timestamp() - now


def never_fits(limits: QuotaLimits, reserve_tokens: int, month_used: int, month_in_flight: int) -> str | None:
    """The limit a request can never fit, whatever else is in the way now (the rpm, the concurrency slots): one
    larger than the per-minute token limit ("tokens"), or than what is left of the monthly budget even if the
    tenant's running requests used none of their reservations ("monthly_budget"); None if waiting may help.
    Checked before every other limit, so that no client is told to retry a request that cannot succeed. The
    Redis script (quotas/redis.py) checks the same conditions, in the same order."""
    if reserve_tokens > limits.tokens_per_minute:
        return "tokens"
    if month_used - month_in_flight + reserve_tokens > limits.monthly_token_budget:
        return "monthly_budget"
    return None


def exceeded(kind: str, limits: QuotaLimits, used_requests: int, used_tokens: int, reset_in: float,
             now: float, reserve_tokens: int, *, month_used: int | None = None, month_in_flight: int = 0,
             window_in_flight: int = 0, slots_free_in: float | None = None) -> QuotaExceeded:
    """month_in_flight, window_in_flight: of month_used and of used_tokens, the tokens still reserved by this
    tenant's running requests (they give back what they do not use when they finish; they may use it all).
    slots_free_in: for the concurrency limit, seconds until a slot frees for certain, where every slot is held
    by a request whose process stopped keeping it alive (None: some are live and may finish any moment)."""
    headers = rate_headers(limits, used_requests, used_tokens, reset_in)
    retry_after = reset_in
    futile = False  # a retry cannot succeed (soon): told to clients with x-should-retry: false
    if kind == "requests":
        msg = f"Rate limit reached for requests: limit {limits.requests_per_minute} per minute."
    elif kind == "tokens":
        msg = (f"Rate limit reached for tokens: limit {limits.tokens_per_minute} per minute, "
               f"used {used_tokens}, requested {reserve_tokens}.")
        if reserve_tokens > limits.tokens_per_minute:
            msg += " The request alone exceeds the limit: lower max_tokens or the prompt length."
            futile = True
        elif window_in_flight > 0 and used_tokens - window_in_flight + reserve_tokens <= limits.tokens_per_minute:
            # short only because running requests hold reservations, which they settle within seconds
            msg += (f" Of those used, {window_in_flight} are reserved by requests still running: this request "
                    "fits once they finish if they use less than they reserved; if not, the window turns in "
                    f"{math.ceil(reset_in)} s. Lowering max_tokens may let it fit now.")
            retry_after = 1.0
    elif kind == "concurrent":
        msg = f"Too many concurrent requests: limit {limits.max_concurrent}."
        retry_after = 1.0
        if slots_free_in is not None:
            msg += (" The slots are held by requests of a server process that stopped without finishing them; "
                    f"the first is freed in {math.ceil(slots_free_in)} s.")
            retry_after = slots_free_in
    else:
        budget = limits.monthly_token_budget
        settled = None if month_used is None else month_used - month_in_flight
        if month_in_flight > 0 and settled is not None and settled + reserve_tokens <= budget:
            # short only because running requests hold reservations: a retry helps if, and only if, they
            # use less than they reserved, which cannot be known before they finish
            msg = (f"Monthly token budget of {budget} tokens: {settled} used and {month_in_flight} reserved by "
                   f"requests still running, {max(0, budget - month_used)} free; this request may use up to "
                   f"{reserve_tokens} (its prompt plus max_tokens). It fits once they finish only if they use "
                   "less than they reserved; lower max_tokens to fit what is free now.")
            headers["retry-after"] = "1"
            return QuotaExceeded(msg, kind=kind, retry_after=1.0, headers=headers)
        if month_used is None or month_used >= budget:
            msg = f"Monthly token budget of {budget} tokens is used up."
        else:
            # what is left would not cover this request's reservation (its prompt plus max_tokens)
            msg = (f"Monthly token budget of {budget} tokens: {month_used} used, {budget - month_used} left, "
                   f"and this request may use up to {reserve_tokens} (its prompt plus max_tokens). "
                   "Lower max_tokens or shorten the prompt.")
        retry_after = seconds_to_next_month(now)
        futile = True
    if futile:
        # OpenAI's SDKs retry a 429 (waiting at most a minute whatever Retry-After says) unless told not to
        headers["x-should-retry"] = "false"
    if not (kind == "tokens" and futile):  # no wait makes a request larger than the limit fit
        headers["retry-after"] = str(max(1, math.ceil(retry_after)))
    return QuotaExceeded(msg, kind=kind, retry_after=retry_after, headers=headers)
