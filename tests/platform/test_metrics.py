"""/metrics exposition: parses as Prometheus text, bounded label sets, engine numbers read at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.client import EngineStats
from loraplex.platform.metrics import OTHER, FinishedRequest, PlatformMetrics, RecentWindow, TopN, percentile


def _samples(metrics: PlatformMetrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _record(m: PlatformMetrics, *, tenant="t1", adapter=None, prompt=10, completion=5, status="ok"):
    m.record_request(
        endpoint="chat", status=status, tenant=tenant, adapter=adapter,
        prompt_tokens=prompt, completion_tokens=completion, ttft_s=0.05, e2e_s=0.45,
    )


def test_exposition_parses_and_counts_requests_tokens_and_latency():
    m = PlatformMetrics()
    _record(m, adapter="sql@1")
    _record(m, adapter=None, prompt=3, completion=1)
    _record(m, status="weird")
    s = _samples(m)
    assert s[("loraplex_requests_total", (("endpoint", "chat"), ("status", "ok"), ("tenant", "t1")))] == 2
    assert s[("loraplex_requests_total", (("endpoint", "chat"), ("status", OTHER), ("tenant", "t1")))] == 1
    assert s[("loraplex_tokens_total", (("kind", "prompt"), ("tenant", "t1")))] == 23
    assert s[("loraplex_adapter_requests_total", (("adapter", "sql@1"), ("tenant", "t1")))] == 1
    assert s[("loraplex_adapter_requests_total", (("adapter", "base"), ("tenant", "t1")))] == 2
    assert s[("loraplex_time_to_first_token_seconds_count", (("endpoint", "chat"),))] == 3
    # TPOT: (0.45 - 0.05) / (5 - 1) = 0.1 per token, observed for the two requests with >1 output token
    assert s[("loraplex_time_per_output_token_seconds_count", (("endpoint", "chat"),))] == 2
    assert abs(s[("loraplex_time_per_output_token_seconds_sum", (("endpoint", "chat"),))] - 0.2) < 1e-9
    assert s[("loraplex_request_duration_seconds_count", (("endpoint", "chat"), ("tenant", "t1")))] == 3


def test_engine_stats_are_exposed_at_scrape_time():
    m = PlatformMetrics()
    stats = EngineStats(
        num_running=3, num_waiting=7, kv_blocks_total=100, kv_blocks_used=25, lora_slots_total=4,
        lora_slots_used=2, lora_resident=["h1", "h2"], lora_host_cached=["h3"], lora_loads_total=9,
        lora_evictions_total=4, lora_hits_total=30, lora_misses_total=9,
    )
    m.bind_engine(lambda: stats)
    s = _samples(m)
    assert s[("loraplex_engine_queue_depth", ())] == 7
    assert s[("loraplex_engine_running_requests", ())] == 3
    assert s[("loraplex_kv_cache_usage_ratio", ())] == 0.25
    assert s[("loraplex_adapter_resident_device", ())] == 2
    assert s[("loraplex_adapter_loads_total", ())] == 9
    assert s[("loraplex_adapter_evictions_total", ())] == 4
    assert s[("loraplex_adapter_cache_hits_total", ())] == 30
    assert s[("loraplex_adapter_cached", (("level", "device"), ("version", "h1")))] == 1
    assert s[("loraplex_adapter_cached", (("level", "host"), ("version", "h3")))] == 1
    stats.num_waiting = 1
    assert _samples(m)[("loraplex_engine_queue_depth", ())] == 1


def test_an_adapter_held_by_several_engines_is_one_series_counting_them():
    """API processes sum the stats of every engine process: a version two engines hold is one sample (value 2),
    not the same series twice (which Prometheus drops as a duplicate)."""
    from loraplex.platform.remote.protocol import add_stats, stats_to_json

    total = EngineStats()
    for resident in (["a" * 64, "b" * 64], ["a" * 64]):
        one = EngineStats(lora_resident=resident, lora_host_cached=resident)
        one.extra["lora_pinned"] = ["a" * 64]
        add_stats(total, stats_to_json(one))
    m = PlatformMetrics()
    m.bind_engine(lambda: total)
    body = m.exposition()[0].decode()
    cached = [line for line in body.splitlines() if line.startswith("loraplex_adapter_cached{")]
    assert len(cached) == len(set(cached)) == 5, cached
    s = _samples(m)
    assert s[("loraplex_adapter_cached", (("level", "device"), ("version", "a" * 12)))] == 2
    assert s[("loraplex_adapter_cached", (("level", "device"), ("version", "b" * 12)))] == 1
    assert s[("loraplex_adapter_cached", (("level", "pinned"), ("version", "a" * 12)))] == 2


def test_a_failing_engine_does_not_break_the_scrape():
    m = PlatformMetrics()

    def broken():
        raise RuntimeError("engine restarting")

    m.bind_engine(broken)
    _record(m)
    assert ("loraplex_engine_queue_depth", ()) not in _samples(m)


def test_adapter_labels_are_bounded_to_top_n_plus_other():
    m = PlatformMetrics(adapter_top_n=3)
    for i in range(50):
        _record(m, adapter=f"a{i}@1")
    labels = {k[1][0][1] for k in _samples(m) if k[0] == "loraplex_adapter_requests_total"}
    assert labels == {"a0@1", "a1@1", "a2@1", OTHER}


def test_two_tenants_adapters_of_one_name_are_counted_apart():
    m = PlatformMetrics()
    _record(m, tenant="acme", adapter="bot@1a2b3c", completion=5)
    _record(m, tenant="beta", adapter="bot@1a2b3c", completion=7)
    s = _samples(m)
    for tenant, completion in (("acme", 5), ("beta", 7)):
        assert s[("loraplex_adapter_requests_total", (("adapter", "bot@1a2b3c"), ("tenant", tenant)))] == 1
        key = (("adapter", "bot@1a2b3c"), ("kind", "completion"), ("tenant", tenant))
        assert s[("loraplex_adapter_tokens_total", key)] == completion


def test_top_n_follows_the_busiest_names_of_the_last_window():
    now = [0.0]
    top = TopN(limit=2, window_s=10, clock=lambda: now[0])
    assert top.label("a") == ("a", [])
    assert top.label("b") == ("b", [])
    assert top.label("c") == (OTHER, [])
    for _ in range(5):
        top.label("c")
    now[0] = 11.0
    label, dropped = top.label("c")  # the window rolls: c and a (tie, first seen) stay, b's series go
    assert label == "c"
    assert dropped == ["b"]
    assert top.label("b")[0] == OTHER


def test_dropped_names_lose_their_series():
    m = PlatformMetrics(adapter_top_n=1, window_s=0.0)
    _record(m, adapter="x@1")
    _record(m, adapter="y@1")
    _record(m, adapter="y@1")
    # every call rolls the window: x held the one slot, then y was busiest, so x's series are dropped
    series = {k[1][0][1]: v for k, v in _samples(m).items() if k[0] == "loraplex_adapter_requests_total"}
    assert series == {"y@1": 1, OTHER: 1}


def test_recent_window_percentiles_and_throughput():
    now = [100.0]
    w = RecentWindow(window_s=10, clock=lambda: now[0])
    for i in range(1, 21):
        w.add(FinishedRequest(at=95.0, ttft_s=i / 100, tpot_s=0.01, e2e_s=1.0, completion_tokens=5))
    w.add(FinishedRequest(at=80.0, ttft_s=9.0, tpot_s=9.0, e2e_s=9.0, completion_tokens=1000))  # outside the window
    summary = w.summary()
    assert summary["requests"] == 20
    assert summary["tokens_per_s"] == 10.0
    assert summary["ttft_p50_s"] == 0.10
    assert summary["ttft_p95_s"] == 0.19
    assert percentile([], 0.5) is None


def test_engine_counters_of_engine_processes_are_per_engine_and_do_not_drop_when_one_leaves():
    """An API process with `loraplex engine`s: each engine's series carries its `engine` label. A sum over the
    registered engines went down when one left, which Prometheus reads as a counter reset (rate() spikes)."""
    from loraplex.config import Settings
    from loraplex.platform.remote.protocol import stats_to_json
    from loraplex.platform.remote.router import EngineRouter

    router = EngineRouter(Settings(environment="test", model="m"), redis=None, tokenizer=None, max_model_len=64)
    for engine_id, tokens in (("e1", 100), ("e2", 40)):
        one = EngineStats(generation_tokens_total=tokens, lora_resident=["a" * 64])
        router.records[engine_id] = {"engine_id": engine_id, "running": 0, "waiting": 0, "stats": stats_to_json(one)}
    m = PlatformMetrics()
    m.bind_engine(router.stats, router.stats_by_engine)
    s = _samples(m)
    assert s[("loraplex_engine_generation_tokens_total", (("engine", "e1"),))] == 100
    assert s[("loraplex_engine_generation_tokens_total", (("engine", "e2"),))] == 40
    assert ("loraplex_engine_generation_tokens_total", ()) not in s
    assert s[("loraplex_adapter_cached", (("engine", "e2"), ("level", "device"), ("version", "a" * 12)))] == 1
    del router.records["e2"]  # it left
    s = _samples(m)
    assert s[("loraplex_engine_generation_tokens_total", (("engine", "e1"),))] == 100  # not reset
    assert ("loraplex_engine_generation_tokens_total", (("engine", "e2"),)) not in s
