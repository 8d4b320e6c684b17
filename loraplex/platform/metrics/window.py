"""The last minute of finished requests: throughput and latency percentiles for the live dashboard."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FinishedRequest:
    at: float
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    completion_tokens: int


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class RecentWindow:
    """The last `window_s` seconds of finished requests: throughput and latency percentiles for the dashboard."""

    def __init__(self, window_s: float = 60.0, max_items: int = 20_000, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._items: deque[FinishedRequest] = deque(maxlen=max_items)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock()

    def add(self, item: FinishedRequest) -> None:
        with self._lock:
            self._items.append(item)

    def summary(self) -> dict[str, float | int | None]:
        now = self._clock()
        with self._lock:
            while self._items and now - self._items[0].at > self.window_s:
                self._items.popleft()
            items = [i for i in self._items if now - i.at <= self.window_s]
        ttfts = sorted(i.ttft_s for i in items if i.ttft_s is not None)
        tpots = sorted(i.tpot_s for i in items if i.tpot_s is not None)
        tokens = sum(i.completion_tokens for i in items)
        return {
            "window_s": self.window_s,
            "requests": len(items),
            "requests_per_s": len(items) / self.window_s,
            "tokens_per_s": tokens / self.window_s,
            "ttft_p50_s": percentile(ttfts, 0.50),
            "ttft_p95_s": percentile(ttfts, 0.95),
            "tpot_p50_s": percentile(tpots, 0.50),
            "tpot_p95_s": percentile(tpots, 0.95),
        }
