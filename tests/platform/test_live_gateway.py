"""Live-server behaviour where the fake engine's timing makes the test sharp: disconnects, cut-off
uploads, and many concurrent clients under tight quotas."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fake_engine import FakeEngine
from live_server import live_server
from platform_helpers import make_settings
from sqlalchemy import select

from loraplex.platform.models import UsageRecord


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_client_disconnect_mid_stream_aborts_engine_request(data_dir, tiny_llama_dir, make_tenant_factory):
    engine = FakeEngine(token_delay=0.02)
    settings = make_settings(data_dir, model=str(tiny_llama_dir))
    app, make = make_tenant_factory(settings, engine)
    with live_server(app) as url:
        tenant = make()
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions", headers=tenant.headers, json={
                    "model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                    "stream": True}) as response:
                request_id = response.headers["x-request-id"]
                lines = response.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
                assert request_id in engine.running
        # closing the connection is all the client does; the engine must drop the request promptly
        assert _wait_until(lambda: request_id in engine.aborted, timeout=2.0), engine.aborted
        generated = engine.generated_tokens
        assert generated < 200
        asyncio.run_coroutine_threadsafe(app.state.services.usage.flush(), _loop()).result(10)
        with app.state.services.sessions() as session:
            record = session.scalar(select(UsageRecord).where(UsageRecord.request_id == request_id))
        assert record.status == "cancelled" and 0 < record.completion_tokens < 200
        assert not app.state.services.limiter._inflight[tenant.tenant_id]


def test_client_disconnect_on_non_streaming_request_aborts(data_dir, tiny_llama_dir, make_tenant_factory):
    engine = FakeEngine(token_delay=0.02)
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir)), engine)
    with live_server(app) as url:
        tenant = make()
        try:  # 200 tokens take the fake engine 4 s; the client gives up long before
            httpx.post(f"{url}/v1/completions", headers=tenant.headers, timeout=1.5,
                       json={"model": "fake-base", "prompt": "hi", "max_tokens": 200})
        except httpx.TimeoutException:
            pass
        assert _wait_until(lambda: len(engine.aborted) == 1, timeout=2.0), (engine.requests, engine.finished)
        assert not engine.finished and engine.generated_tokens < 200
        limiter = app.state.services.limiter
        assert _wait_until(lambda: not limiter._inflight[tenant.tenant_id], timeout=2.0)  # slot given back


def test_client_that_leaves_a_stream_before_its_first_token_aborts_it(data_dir, tiny_llama_dir,
                                                                       make_tenant_factory):
    """A streamed request still in the queue when its client gives up is aborted there and billed nothing,
    as one that is not streamed is; the engine must not run it for nobody."""
    engine = FakeEngine(first_token_delay=4.0)
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir)), engine)
    with live_server(app) as url:
        tenant = make()
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            before = len(engine.aborted)
            try:
                httpx.post(f"{url}{path}", headers=tenant.headers, timeout=1.0,
                           json={"model": "fake-base", "max_tokens": 5, "stream": True, **body})
            except httpx.TimeoutException:
                pass
            # the first token was due 4 s after the request; the abort comes right after the client left
            assert _wait_until(lambda n=before + 1: len(engine.aborted) == n, timeout=2.0), (path, engine.aborted)
            assert not engine.finished and engine.generated_tokens == 0
            assert _wait_until(lambda: not app.state.services.limiter._inflight[tenant.tenant_id], timeout=2.0)
        asyncio.run_coroutine_threadsafe(app.state.services.usage.flush(), _loop()).result(10)
        with app.state.services.sessions() as session:
            records = session.scalars(select(UsageRecord)).all()
        assert sorted(r.endpoint for r in records) == ["chat.completions", "completions"]
        assert all(r.status == "cancelled" and r.prompt_tokens == 0 and r.completion_tokens == 0 for r in records)


def _usage_records(app) -> list[UsageRecord]:
    asyncio.run_coroutine_threadsafe(app.state.services.usage.flush(), _loop()).result(10)
    with app.state.services.sessions() as session:
        return session.scalars(select(UsageRecord)).all()


def _tokens_counted(app, tenant_id: int) -> tuple[int, int]:
    """(this minute's, this month's) tokens the limiter counts for the tenant."""
    return asyncio.run_coroutine_threadsafe(app.state.services.limiter.used_now(tenant_id), _loop()).result(10)


def test_a_client_that_leaves_during_its_prefill_is_billed_its_prompt(data_dir, tiny_llama_dir,
                                                                     make_tenant_factory):
    """The engine had begun the prompt when the client hung up: the prompt tokens it processed are billed
    and counted against the limits, streamed or not; no completion token is."""
    from loraplex.platform.quotas.memory import MemoryQuotaLimiter

    engine = FakeEngine(prefill_delay=4.0)
    frozen = time.time()
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir)), engine,
                                    limiter=MemoryQuotaLimiter(clock=lambda: frozen))
    with live_server(app) as url:
        tenant = make()
        for stream in (False, True):
            try:
                httpx.post(f"{url}/v1/completions", headers=tenant.headers, timeout=1.0,
                           json={"model": "fake-base", "prompt": "word " * 30, "max_tokens": 5, "stream": stream})
            except httpx.TimeoutException:
                pass
            assert _wait_until(lambda: not app.state.services.limiter._inflight[tenant.tenant_id], timeout=2.0)
        assert not engine.finished and engine.generated_tokens == 0
        records = _usage_records(app)
        assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [("cancelled", 150, 0)] * 2
        assert _tokens_counted(app, tenant.tenant_id) == (300, 300)


def _gate_model_runs(engine):
    """Make each model run of a real engine's step (after the step has scheduled its batch) wait for
    `gate.release()`: a step under way, as a long prefill is."""
    import threading

    gate = threading.Semaphore(0)
    run = engine.engine.runner.run

    def gated_run(batch):
        gate.acquire(timeout=30)
        return run(batch)

    engine.engine.runner.run = gated_run
    return gate


def test_the_embedded_engine_bills_a_prefill_its_client_left(data_dir, tiny_llama_dir, make_tenant_factory):
    """On the real engine: a client times out while the step with its prefill runs (the step goes on, and
    here finishes the request for nobody); the request is billed its prompt and the limits count it."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.platform.quotas.memory import MemoryQuotaLimiter

    real = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256))
    asyncio.run(real.start())
    gate = _gate_model_runs(real)
    frozen = time.time()
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir), served_model_name="tiny"),
                                    real, limiter=MemoryQuotaLimiter(clock=lambda: frozen))
    prompt = "The quick brown fox jumps over the lazy dog"
    try:
        with live_server(app) as url:
            tenant = make()
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{url}/v1/completions", headers=tenant.headers, timeout=1.0,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            gate.release()  # the prefill under way when the client left runs to its end
            assert _wait_until(lambda: not app.state.services.limiter._inflight[tenant.tenant_id], timeout=5.0)
            [record] = _usage_records(app)
            billed = len(real.encode(prompt))
            assert (record.status, record.prompt_tokens, record.completion_tokens) == ("cancelled", billed, 0)
            assert _tokens_counted(app, tenant.tenant_id) == (billed, billed)
    finally:
        for _ in range(20):
            gate.release()
        asyncio.run(real.shutdown())


def test_streamed_upload_is_cut_off_at_the_limit(data_dir, tiny_llama_dir, make_tenant_factory):
    limit = 256 * 1024
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir), max_upload_bytes=limit),
                                    FakeEngine())
    sent = 0
    total = 16 * 1024 * 1024
    boundary = "b0undary"
    read = 0  # body bytes the server's app took in (the client's count includes what socket buffers absorb)

    async def counting(scope, receive, send):
        async def counted():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
            return message

        await app(scope, counted, send)

    def body():
        nonlocal sent
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbig\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.zip\"\r\n"
                "Content-Type: application/zip\r\n\r\n").encode()
        yield head
        chunk = b"\0" * 65536
        while sent < total:
            sent += len(chunk)
            yield chunk
        yield f"\r\n--{boundary}--\r\n".encode()

    with live_server(counting) as url:
        tenant = make()
        status = None
        try:
            r = httpx.post(f"{url}/v1/adapters", headers={**tenant.headers,
                           "content-type": f"multipart/form-data; boundary={boundary}"}, content=body(), timeout=30)
            status = r.status_code
            assert r.json()["error"]["code"] == "upload_too_large"
        except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server answered 413 and closed while we were still sending
        assert status in (None, 413)
        # the app stops at the limit; what reaches it past that is at most the server's read-ahead
        assert read < limit + 1024 * 1024, f"the server read {read} bytes of a {limit}-byte limit"
        assert sent < total or status == 413
        uploads = app.state.services.settings.data_dir / "uploads"
        assert not uploads.exists() or not any(uploads.iterdir())


def _loop():
    from loraplex.platform.tasks.context import get_context

    return get_context().loop


class CountingEngine:
    """Delegates to a real engine and records how many requests each tenant has running at once."""

    def __init__(self, engine):
        self.engine = engine
        self.running: dict[str | None, int] = {}
        self.max_running: dict[str | None, int] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt, params, request_id, *, adapter=None, tenant=None):
        self.running[tenant] = self.running.get(tenant, 0) + 1
        self.max_running[tenant] = max(self.max_running.get(tenant, 0), self.running[tenant])
        try:
            async for out in self.engine.generate(prompt, params, request_id, adapter=adapter, tenant=tenant):
                yield out
        finally:
            self.running[tenant] -= 1


def test_many_clients_three_tenants_tight_quotas(data_dir, tiny_llama_dir, make_tenant_factory):
    """200 requests from 20 concurrent clients across 3 tenants, on the real engine (tiny model)."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.platform.quotas.memory import MemoryQuotaLimiter

    real = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=512, max_model_len=256))
    engine = CountingEngine(real)
    asyncio.run(real.start())  # the step thread outlives this loop; the server's loop drives the streams
    frozen = time.time()  # one quota window for the whole test, whatever the wall clock does
    app, make = make_tenant_factory(make_settings(data_dir, model=str(tiny_llama_dir), served_model_name="tiny"),
                                    engine, limiter=MemoryQuotaLimiter(clock=lambda: frozen))
    try:
        with live_server(app) as url:
            _run_many_clients(app, url, make, engine)
    finally:
        asyncio.run(real.shutdown())


def _run_many_clients(app, url, make, engine) -> None:
    tenants = {
        "conc": make(max_concurrent=2),
        "rpm": make(requests_per_minute=25),
        "tpm": make(tokens_per_minute=600),
    }
    generated_before = engine.stats().generation_tokens_total
    results: list[tuple[str, int, str, dict | None]] = []

    async def worker(client_index: int):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for i in range(10):
                label = list(tenants)[(client_index + i) % 3]
                r = await client.post("/v1/completions", headers=tenants[label].headers, json={
                    "model": "tiny", "prompt": f"request {client_index}-{i}", "max_tokens": 8,
                    "ignore_eos": True})
                usage = r.json().get("usage") if r.status_code == 200 else None
                results.append((label, r.status_code, r.headers["x-request-id"], usage))

    async def main():
        await asyncio.gather(*(worker(c) for c in range(20)))

    asyncio.run(main())
    assert len(results) == 200
    assert {status for _, status, _, _ in results} <= {200, 429}
    ok = {label: [(rid, u) for lab, s, rid, u in results if lab == label and s == 200] for label in tenants}

    tenant_of = {str(t.tenant_id): label for label, t in tenants.items()}
    max_running = {tenant_of[k]: v for k, v in engine.max_running.items()}
    assert max_running["conc"] <= 2
    assert len(ok["rpm"]) == 25
    tpm_tokens = sum(u["total_tokens"] for _, u in ok["tpm"])
    assert 0 < tpm_tokens <= 600
    assert any(s == 429 for lab, s, _, _ in results if lab == "tpm")
    assert all(u["completion_tokens"] == 8 for label in ok for _, u in ok[label])

    asyncio.run_coroutine_threadsafe(app.state.services.usage.flush(), _loop()).result(30)
    with app.state.services.sessions() as session:
        records = session.scalars(select(UsageRecord)).all()
    completed = {rid: (label, u) for label in ok for rid, u in ok[label]}
    assert sorted(r.request_id for r in records) == sorted(completed)  # one record each, no extras
    for r in records:
        label, usage = completed[r.request_id]
        assert r.tenant_id == tenants[label].tenant_id
        assert (r.prompt_tokens, r.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    # the engine generated exactly the tokens the records bill
    assert sum(r.completion_tokens for r in records) == engine.stats().generation_tokens_total - generated_before
