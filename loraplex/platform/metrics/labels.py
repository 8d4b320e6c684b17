"""Bounded label sets, so per-adapter and per-tenant series cannot grow without limit."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

OTHER = "other"


class TopN:
    """A bounded label set: the `limit` busiest names of the previous window, plus newcomers while room lasts.

    Each label's series only ever grows while it exists; a name that leaves the top set has its series
    removed (returned by `label` so the caller can drop them), which keeps cardinality at `limit + 1`.
    """

    def __init__(self, limit: int, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._counts: Counter[str] = Counter()
        self._labelled: set[str] = set()

    def label(self, name: str) -> tuple[str, list[str]]:
        """The label to use for `name`, and names whose series must be dropped now."""
        dropped = self._maybe_roll()
        self._counts[name] += 1
        if name in self._labelled:
            return name, dropped
        if len(self._labelled) < self.limit:
            self._labelled.add(name)
            return name, dropped
        return OTHER, dropped

    def _maybe_roll(self) -> list[str]:
        now = self._clock()
        if now - self._window_start < self.window_s:
            return []
        top = {name for name, _ in self._counts.most_common(self.limit)}
        dropped = sorted(self._labelled - top)
        self._labelled = top
        self._counts = Counter()
        self._window_start = now
        return dropped
