"""/metrics on a running app: requests through the OpenAI API show up per tenant, adapter and endpoint."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_inference_requests_are_counted_and_timed(client, make_tenant):
    tk = make_tenant("acme")
    for _ in range(2):
        r = client.post("/v1/chat/completions", headers=tk.headers, json={
            "model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
    samples = _scrape(client)
    key = ("loraplex_requests_total", (("endpoint", "chat.completions"), ("status", "ok"), ("tenant", "acme")))
    assert samples[key] == 2
    assert samples[("loraplex_tokens_total", (("kind", "completion"), ("tenant", "acme")))] == 8
    assert samples[("loraplex_adapter_requests_total", (("adapter", "base"), ("tenant", "acme")))] == 2
    assert samples[("loraplex_time_to_first_token_seconds_count", (("endpoint", "chat.completions"),))] == 2
    assert samples[("loraplex_request_duration_seconds_count",
                    (("endpoint", "chat.completions"), ("tenant", "acme")))] == 2
    assert ("loraplex_engine_queue_depth", ()) in samples


def test_rejections_over_quota_are_counted(client, make_tenant):
    tk = make_tenant("tight", requests_per_minute=1)
    body = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", headers=tk.headers, json=body).status_code == 200
    assert client.post("/v1/chat/completions", headers=tk.headers, json=body).status_code == 429
    samples = _scrape(client)
    key = ("loraplex_requests_total", (("endpoint", "chat.completions"), ("status", "rejected"), ("tenant", "tight")))
    assert samples[key] == 1


def test_scrape_token_guards_metrics_when_set(settings, fake_engine):
    from fastapi.testclient import TestClient

    from loraplex.platform.app import create_app

    guarded = settings.model_copy(update={"metrics_token": "scrape-secret-123"})
    with TestClient(create_app(guarded, engine=fake_engine)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic scrape-secret-123"}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            assert "LORAPLEX_METRICS_TOKEN" in r.json()["error"]["message"]
        r = c.get("/metrics", headers={"Authorization": "Bearer scrape-secret-123"})
        assert r.status_code == 200 and "loraplex_" in r.text


def test_requests_refused_for_want_of_an_engine_are_counted(app, client, make_tenant, fake_engine):
    """An engine outage answered 503 is the server's failure: /metrics counts it (status "unavailable") and
    the tenant's usage shows it as a failed request with no tokens, as the README says."""
    import asyncio

    tk = make_tenant("outage")
    fake_engine.failure = "device lost"
    try:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = client.post(path, headers=tk.headers, json={"model": "fake-base", "max_tokens": 2, **body})
            assert r.status_code == 503, r.text
    finally:
        del fake_engine.failure
    samples = _scrape(client)
    for endpoint in ("chat.completions", "completions"):
        key = ("loraplex_requests_total", (("endpoint", endpoint), ("status", "unavailable"), ("tenant", "outage")))
        assert samples[key] == 1
    from loraplex.platform.tasks.context import get_context

    asyncio.run_coroutine_threadsafe(app.state.services.usage.flush(), get_context().loop).result(10)
    buckets = client.get("/v1/usage", headers=tk.headers).json()["data"]
    assert sum(b["failed_requests"] for b in buckets) == 2, buckets
    assert sum(b["requests"] for b in buckets) == 2 and sum(b["total_tokens"] for b in buckets) == 0
