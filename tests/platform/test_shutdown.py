"""`loraplex serve` stopping (SIGTERM) with inference requests still running past LORAPLEX_SHUTDOWN_TIMEOUT:
each ends the service's way (a JSON 503 with its request id, or an error event and [DONE] in its stream),
settles its quota and is recorded as failed on the server's side (not billed) before the journal closes."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine
from live_server import free_port
from platform_helpers import make_settings
from sqlalchemy import select

from loraplex.platform.models import UsageRecord
from loraplex.platform.quotas.memory import MemoryQuotaLimiter
from loraplex.platform.stopping import StoppingServer

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class SlowSettleLimiter(MemoryQuotaLimiter):
    """Settles a quarter of a second late, as a remote Redis may: the shutdown must wait for it."""

    async def settle(self, reservation, used_tokens: int, **kwargs) -> None:
        await asyncio.sleep(0.25)
        await super().settle(reservation, used_tokens, **kwargs)


def _run_and_stop(data_dir, tiny_llama_dir, make_tenant_factory, *, grace: float, backstop: float,
                  redis: bool = False):
    """Serve two long chat requests (one streamed), stop the server while they run; returns (services,
    tenant, plain response, stream text). `redis`: quotas and the usage journal in Redis (production)."""
    engine = FakeEngine(token_delay=0.05)  # 255 tokens: about 13 s per request
    extra = {}
    if redis:
        prefix = f"lpxtest-stop-{uuid.uuid4().hex[:8]}"
        extra = {"redis_url": REDIS_URL, "redis_prefix": prefix, "task_queue": f"{prefix}-tasks",
                 "engine_queue": f"{prefix}-engine"}
    limiter = None if redis else SlowSettleLimiter()
    app, make_tenant = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir), **extra), engine,
                                           limiter)
    tenant = make_tenant()
    services = app.state.services
    port = free_port()
    server = StoppingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=backstop), services, grace=grace)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    results: dict = {}

    def plain() -> None:
        results["plain"] = httpx.post(url, headers=tenant.headers, json=body, timeout=60)

    def streamed() -> None:
        try:
            with httpx.stream("POST", url, headers=tenant.headers, json={**body, "stream": True}, timeout=60) as r:
                results["stream"] = r.read().decode()
        except httpx.HTTPError as exc:
            results["stream"] = repr(exc)

    clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 30
    while len(engine.running) < 2:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.01)
    time.sleep(0.3)  # a few tokens each
    server.should_exit = True  # what SIGTERM does
    for c in clients:
        c.join(timeout=60)
    thread.join(timeout=60)
    assert not thread.is_alive()
    return services, tenant, results["plain"], results["stream"]


def test_requests_still_running_at_the_shutdown_timeout_end_with_an_error_and_are_not_billed(
        data_dir, tiny_llama_dir, make_tenant_factory):
    services, tenant, plain_response, stream_text = _run_and_stop(
        data_dir, tiny_llama_dir, make_tenant_factory, grace=0.5, backstop=30)
    assert plain_response.status_code == 503, plain_response.text
    error = plain_response.json()["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error", error
    request_id = plain_response.headers["x-request-id"]
    assert request_id in error["message"]
    events = [line[len("data: "):] for line in stream_text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-2]
    assert len(events) > 3  # tokens were streamed before the stop

    assert not services.running
    with services.sessions() as s:
        rows = s.scalars(select(UsageRecord)).all()
    assert sorted(r.status for r in rows) == ["error", "error"], [(r.status, r.completion_tokens) for r in rows]
    assert request_id in {r.request_id for r in rows}
    limiter = services.limiter
    assert not limiter._inflight[tenant.tenant_id] and not limiter._held[tenant.tenant_id]  # all settled
    assert sum(limiter._monthly.values()) == 0  # failed on the server's side: nothing counted


@pytest.mark.parametrize("redis", [False, pytest.param(True, marks=pytest.mark.integration)],
                         ids=["embedded", "redis"])
def test_requests_cancelled_by_the_backstop_still_settle_and_journal_before_the_journal_closes(
        data_dir, tiny_llama_dir, make_tenant_factory, redis):
    """Past uvicorn's own graceful timeout the request tasks are cancelled and the app's shutdown starts at
    once: the requests' shielded settlement must still reach the journal it is about to close."""
    services, tenant, _plain, _stream = _run_and_stop(data_dir, tiny_llama_dir, make_tenant_factory,
                                                      grace=30, backstop=0.3, redis=redis)
    assert not services.running
    with services.sessions() as s:
        rows = s.scalars(select(UsageRecord)).all()
    assert len(rows) == 2 and all(r.completion_tokens > 0 for r in rows), [(r.status, r.completion_tokens)
                                                                             for r in rows]
