"""While Redis or the database does not answer, requests get a 503 with Retry-After (not a 500), each with one
log line rather than a traceback, and the background loops log the outage once, not every second."""

from __future__ import annotations

import asyncio
import logging

import pytest

CHAT = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_a_redis_outage_is_a_503_with_retry_after(client, app, make_tenant, monkeypatch, caplog, stream):
    import redis.exceptions

    tenant = make_tenant()

    async def down(*args, **kwargs):
        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(app.state.services.limiter, "acquire", down)
    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/chat/completions", headers=tenant.headers, json={**CHAT, "stream": stream})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable" and r.headers["retry-after"] == "2"
    lines = [rec for rec in caplog.records if "did not answer" in rec.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "redis" in lines[0].getMessage()


def test_the_registry_loop_logs_an_outage_once_and_its_end(monkeypatch, caplog):
    from loraplex.config import Settings
    from loraplex.platform.remote import router as router_module

    monkeypatch.setattr(router_module, "REFRESH_SECONDS", 0)
    router = router_module.EngineRouter(Settings(environment="test"), redis=None, tokenizer=None, max_model_len=8)
    calls = []

    async def refresh():
        calls.append(1)
        if len(calls) <= 5:
            raise ConnectionError("Connection refused")
        if len(calls) > 6:
            raise asyncio.CancelledError

    monkeypatch.setattr(router, "refresh", refresh)
    with caplog.at_level(logging.DEBUG, logger=router_module.log.name), pytest.raises(asyncio.CancelledError):
        asyncio.run(router._refresh_loop())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "failed" in warnings[0] and "restored" in warnings[1], warnings
