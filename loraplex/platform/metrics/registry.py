"""The platform's Prometheus registry: request, token and latency metrics, plus the engine collector."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from loraplex.engine.client import EngineStats
from loraplex.platform.metrics.engine import EngineCollector
from loraplex.platform.metrics.labels import OTHER, TopN
from loraplex.platform.metrics.window import FinishedRequest, RecentWindow

# one process serves one platform; the *_created series only double the scrape size
disable_created_metrics()

BASE_MODEL_LABEL = "base"
STATUSES = frozenset({"ok", "error", "cancelled", "aborted", "rejected", "unavailable"})
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class PlatformMetrics:
    def __init__(self, *, adapter_top_n: int = 20, tenant_top_n: int = 50, window_s: float = 300.0):
        self.registry = CollectorRegistry(auto_describe=True)
        self.recent = RecentWindow()
        self._engine_stats: Callable[[], EngineStats | None] = lambda: None
        self._stats_by_engine: Callable[[], dict[str, EngineStats] | None] = lambda: None
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
        # per tenant and adapter: two tenants' adapters of one name are different adapters
        self.adapter_requests = PromCounter(
            "loraplex_adapter_requests", "Finished requests per tenant's adapter (top-N, rest as other)",
            ["tenant", "adapter"], registry=r
        )
        self.adapter_tokens = PromCounter(
            "loraplex_adapter_tokens", "Tokens per tenant's adapter (top-N, rest as other)",
            ["tenant", "adapter", "kind"], registry=r
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
        r.register(EngineCollector(lambda: self._engine_stats(), lambda: self._stats_by_engine()))

    def bind_engine(self, stats: Callable[[], EngineStats | None],
                    by_engine: Callable[[], dict[str, EngineStats] | None] = lambda: None) -> None:
        """`by_engine`: each engine process's stats by its id, where the engines are other processes."""
        self._engine_stats, self._stats_by_engine = stats, by_engine

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
            adapter_key, dropped_adapters = self._adapters.label((tenant, adapter or BASE_MODEL_LABEL))
            self._drop(dropped_tenants, dropped_adapters)
        adapter_labels = (OTHER, OTHER) if adapter_key == OTHER else adapter_key
        self.requests.labels(endpoint, status, tenant_label).inc()
        self.tokens.labels("prompt", tenant_label).inc(prompt_tokens)
        self.tokens.labels("completion", tenant_label).inc(completion_tokens)
        self.adapter_requests.labels(*adapter_labels).inc()
        self.adapter_tokens.labels(*adapter_labels, "prompt").inc(prompt_tokens)
        self.adapter_tokens.labels(*adapter_labels, "completion").inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(endpoint).observe(tpot_s)
        self.e2e.labels(endpoint, tenant_label).observe(e2e_s)
        self.recent.add(FinishedRequest(self.recent.now(), ttft_s, tpot_s, e2e_s, completion_tokens))

    def _drop(self, tenants: list[str], adapters: list[tuple[str, str]]) -> None:
        for metric, index in ((self.requests, 2), (self.tokens, 1), (self.e2e, 1)):
            _remove_where(metric, lambda labels, i=index: labels[i] in set(tenants))
        for metric in (self.adapter_requests, self.adapter_tokens):
            _remove_where(metric, lambda labels: (labels[0], labels[1]) in set(adapters))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _remove_where(metric, matches: Callable[[tuple[str, ...]], bool]) -> None:
    # prometheus_client keeps children in a dict keyed by label tuples; remove() is the public way out
    for labels in list(metric._metrics):
        if matches(labels):
            metric.remove(*labels)
