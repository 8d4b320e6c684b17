"""Prometheus metrics for the control plane and its engine, plus the rolling window behind the dashboard.

The request path calls `record_request(app, ...)` once per finished request; engine gauges and counters
are read from `EngineStats` at scrape time. Per-adapter and per-tenant labels are bounded: only the
top-N names by requests in the last window get their own series, the rest share the label "other".
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from loraplex.engine.client import EngineStats

# one process serves one platform; the *_created series only double the scrape size
disable_created_metrics()

OTHER = "other"
BASE_MODEL_LABEL = "base"
STATUSES = frozenset({"ok", "error", "cancelled", "aborted", "rejected"})
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


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


@dataclass(frozen=True)
class _Recent:
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
        self._items: deque[_Recent] = deque(maxlen=max_items)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock()

    def add(self, item: _Recent) -> None:
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


class PlatformMetrics:
    def __init__(self, *, adapter_top_n: int = 20, tenant_top_n: int = 50, window_s: float = 300.0):
        self.registry = CollectorRegistry(auto_describe=True)
        self.recent = RecentWindow()
        self._engine_stats: Callable[[], EngineStats | None] = lambda: None
        self._adapters = TopN(adapter_top_n, window_s)
        self._tenants = TopN(tenant_top_n, window_s)
        self._lock = threading.Lock()
        r = self.registry
        self.requests = PromCounter(
            "loraplex_requests", "Finished inference requests", ["endpoint", "status", "tenant"], registry=r
        )
        self.tokens = PromCounter(
            "loraplex_tokens", "Tokens processed by finished requests", ["kind", "tenant"], registry=r
        )
        self.adapter_requests = PromCounter(
            "loraplex_adapter_requests", "Finished requests per adapter (top-N, rest as other)", ["adapter"], registry=r
        )
        self.adapter_tokens = PromCounter(
            "loraplex_adapter_tokens", "Tokens per adapter (top-N, rest as other)", ["adapter", "kind"], registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds", "Time to first token", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds", "Mean time per output token after the first", ["endpoint"],
            buckets=TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "loraplex_request_duration_seconds", "End-to-end request latency", ["endpoint", "tenant"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        r.register(_EngineCollector(lambda: self._engine_stats()))

    def bind_engine(self, stats: Callable[[], EngineStats | None]) -> None:
        self._engine_stats = stats

    def engine_stats(self) -> EngineStats | None:
        try:
            return self._engine_stats()
        except Exception:  # a scrape must not fail because the engine is restarting
            return None

    def record_request(
        self,
        *,
        endpoint: str,
        status: str,
        tenant: str,
        adapter: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        status = status if status in STATUSES else OTHER
        tpot_s = None
        if ttft_s is not None and completion_tokens > 1:
            tpot_s = max(0.0, e2e_s - ttft_s) / (completion_tokens - 1)
        with self._lock:
            tenant_label, dropped_tenants = self._tenants.label(tenant)
            adapter_label, dropped_adapters = self._adapters.label(adapter or BASE_MODEL_LABEL)
            self._drop(dropped_tenants, dropped_adapters)
        self.requests.labels(endpoint, status, tenant_label).inc()
        self.tokens.labels("prompt", tenant_label).inc(prompt_tokens)
        self.tokens.labels("completion", tenant_label).inc(completion_tokens)
        self.adapter_requests.labels(adapter_label).inc()
        self.adapter_tokens.labels(adapter_label, "prompt").inc(prompt_tokens)
        self.adapter_tokens.labels(adapter_label, "completion").inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(endpoint).observe(tpot_s)
        self.e2e.labels(endpoint, tenant_label).observe(e2e_s)
        self.recent.add(_Recent(self.recent.now(), ttft_s, tpot_s, e2e_s, completion_tokens))

    def _drop(self, tenants: list[str], adapters: list[str]) -> None:
        for metric, index in ((self.requests, 2), (self.tokens, 1), (self.e2e, 1)):
            _remove_where(metric, index, set(tenants))
        for metric, index in ((self.adapter_requests, 0), (self.adapter_tokens, 0)):
            _remove_where(metric, index, set(adapters))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _remove_where(metric, index: int, names: set[str]) -> None:
    if not names:
        return
    # prometheus_client keeps children in a dict keyed by label tuples; remove() is the public way out
    for labels in list(metric._metrics):
        if labels[index] in names:
            metric.remove(*labels)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        try:
            s = self._stats()
        except Exception:
            s = None
        if s is None:
            return
        gauges = {
            "loraplex_engine_running_requests": ("Requests in the running batch", s.num_running),
            "loraplex_engine_queue_depth": ("Requests waiting to be scheduled", s.num_waiting),
            "loraplex_kv_cache_blocks_total": ("KV cache blocks", s.kv_blocks_total),
            "loraplex_kv_cache_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
            "loraplex_kv_cache_blocks_cached": ("Free KV blocks still holding a reusable prefix", s.kv_blocks_cached),
            "loraplex_kv_cache_usage_ratio": (
                "Fraction of KV cache blocks in use", s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            ),
            "loraplex_adapter_slots_total": ("Adapter device slots", s.lora_slots_total),
            "loraplex_adapter_slots_used": ("Adapter device slots holding an adapter", s.lora_slots_used),
            "loraplex_adapter_resident_device": ("Adapters resident in device slots", len(s.lora_resident)),
            "loraplex_adapter_resident_host": ("Adapters in the host cache", len(s.lora_host_cached)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "loraplex_engine_preemptions": ("Requests preempted for lack of KV blocks", s.num_preempted_total),
            "loraplex_engine_prompt_tokens": ("Prompt tokens processed by the engine", s.prompt_tokens_total),
            "loraplex_engine_generation_tokens": ("Tokens generated by the engine", s.generation_tokens_total),
            "loraplex_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            "loraplex_prefix_cache_hits": ("Prompt tokens served from the prefix cache", s.prefix_cache_hits),
            "loraplex_adapter_loads": ("Adapter loads into device slots", s.lora_loads_total),
            "loraplex_adapter_evictions": ("Adapter evictions from device slots", s.lora_evictions_total),
            "loraplex_adapter_cache_hits": ("Requests whose adapter was already resident", s.lora_hits_total),
            "loraplex_adapter_cache_misses": ("Requests that had to load their adapter", s.lora_misses_total),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


def engine_summary(stats: EngineStats | None) -> dict:
    """The engine half of the dashboard, as plain JSON."""
    if stats is None:
        return {"available": False}
    lookups = stats.lora_hits_total + stats.lora_misses_total
    return {
        "available": True,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_blocks_total": stats.kv_blocks_total,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_usage": stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0,
        "prefix_cache_hit_rate": (
            stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else None
        ),
        "lora_slots_total": stats.lora_slots_total,
        "lora_slots_used": stats.lora_slots_used,
        "lora_resident": list(stats.lora_resident),
        "lora_host_cached": list(stats.lora_host_cached),
        "lora_loads_total": stats.lora_loads_total,
        "lora_evictions_total": stats.lora_evictions_total,
        "lora_hit_rate": stats.lora_hits_total / lookups if lookups else None,
        "preempted_total": stats.num_preempted_total,
    }


def get_metrics(app) -> PlatformMetrics:
    """The app's metrics, created on first use so any code path can record without setup order worries."""
    metrics = getattr(app.state, "metrics", None)
    if metrics is None:
        metrics = PlatformMetrics()
        metrics.bind_engine(lambda: _engine_stats_of(app))
        app.state.metrics = metrics
    return metrics


def record_request(app, **fields) -> None:
    """Call once per finished inference request (see PlatformMetrics.record_request for the fields)."""
    get_metrics(app).record_request(**fields)




def _engine_stats_of(app) -> EngineStats | None:
    services = getattr(app.state, "services", None)
    engine = getattr(services, "engine", None)
    return engine.stats() if engine is not None else None


router = APIRouter(include_in_schema=False)


@router.get("/metrics")
def metrics_endpoint(request: Request) -> Response:
    """Prometheus text format. Put it behind the network boundary: it names tenants and adapters."""
    metrics = get_metrics(request.app)
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
