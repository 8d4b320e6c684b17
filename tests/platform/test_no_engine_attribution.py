"""With no engine to serve, the client's own errors still come first (a bad field 400, an unknown model 404),
uncounted; the 503 for the missing engine is an OpenAI error body, a failed request of no tokens, and takes
nothing from the tenant's quotas."""

from __future__ import annotations

import pytest


def _no_engine(monkeypatch, fake_engine) -> None:
    monkeypatch.setattr(type(fake_engine), "available", False, raising=False)


def _usage(client, app, tenant) -> list[dict]:
    client.portal.call(app.state.services.usage.flush)
    return client.get("/v1/usage", headers=tenant.headers).json()["data"]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,extra", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})])
def test_an_unknown_model_is_404_without_an_engine_too(client, app, make_tenant, fake_engine, monkeypatch, path,
                                                       extra):
    _no_engine(monkeypatch, fake_engine)
    tenant = make_tenant()
    r = client.post(path, headers=tenant.headers, json={"model": "no-such-adapter", "max_tokens": 2, **extra})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert _usage(client, app, tenant) == []


@pytest.mark.parametrize("path,extra", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})])
def test_a_refused_field_is_400_without_an_engine_too(client, app, make_tenant, fake_engine, monkeypatch, path,
                                                      extra):
    _no_engine(monkeypatch, fake_engine)
    tenant = make_tenant()
    r = client.post(path, headers=tenant.headers,
                    json={"model": "fake-base", "max_tokens": 2, "logit_bias": {"5": 100}, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias"
    assert _usage(client, app, tenant) == []


@pytest.mark.parametrize("stream", [False, True])
def test_no_engine_is_a_503_error_body_a_failed_request_and_no_quota(client, app, make_tenant, fake_engine,
                                                                     monkeypatch, stream):
    tenant = make_tenant(requests_per_minute=5, tokens_per_minute=1000)
    with monkeypatch.context() as m:
        _no_engine(m, fake_engine)
        r = client.post("/v1/chat/completions", headers=tenant.headers,
                        json={"model": "fake-base", "max_tokens": 200, "stream": stream, **CHAT})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "service_unavailable" and error["message"]
        assert r.headers["retry-after"]
    data = _usage(client, app, tenant)
    assert [(d["requests"], d["failed_requests"], d["prompt_tokens"], d["completion_tokens"]) for d in data] == [
        (1, 1, 0, 0)]
    limiter = app.state.services.limiter
    assert client.portal.call(limiter.used_now, tenant.tenant_id) == (0, 0)
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={"model": "fake-base", "max_tokens": 2,
                                                                           **CHAT})
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "4"  # the first it counts


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_gone_after_admission_settles_the_request(client, app, make_tenant, fake_engine, monkeypatch,
                                                            stream):
    """The last engine process found down between the engine check and the run: a 503, the quota settled (its
    concurrency slot free again), a failed request of no tokens."""
    from loraplex.platform.services import Services

    tenant = make_tenant(max_concurrent=1)
    real = Services.require_engine
    calls = []

    def gone_on_second_call(self):
        calls.append(1)
        if len(calls) == 2:
            from loraplex.platform.errors import unavailable

            raise unavailable("No engine process is serving right now; retry shortly.", retry_after=2)
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(Services, "require_engine", gone_on_second_call)
        r = client.post("/v1/chat/completions", headers=tenant.headers,
                        json={"model": "fake-base", "max_tokens": 2, "stream": stream, **CHAT})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable"
    assert app.state.services.running == {}
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={"model": "fake-base", "max_tokens": 2,
                                                                           **CHAT})
    assert r.status_code == 200, r.text  # the one concurrency slot is free
    data = _usage(client, app, tenant)
    assert [(d["requests"], d["failed_requests"], d["completion_tokens"]) for d in data] == [(2, 1, 2)]
