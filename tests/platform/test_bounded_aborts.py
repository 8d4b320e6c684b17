"""Aborting an unfinished request (its client left, its engine failed, the server stops) waits a bounded time
for the engine to confirm: an engine that never answers neither holds the request's settlement nor the
server's shutdown, which waits for every settlement. The logs name the timeout that ran out."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx


def test_an_abort_the_engine_never_confirms_does_not_hold_the_request(client, app, make_tenant, fake_engine,
                                                                      monkeypatch, caplog):
    from loraplex.platform.inference import job as job_module

    monkeypatch.setattr(job_module, "ABORT_TIMEOUT_SECONDS", 0.2)
    asked = []

    async def never_answers(request_id):
        asked.append(request_id)
        await asyncio.Event().wait()

    monkeypatch.setattr(fake_engine, "abort", never_answers)
    fake_engine.fail_at_step = 2  # the request fails in the engine: its cleanup aborts it there
    tenant = make_tenant(max_concurrent=1)
    result = {}

    def post():  # in a thread: a request that hung on its abort would otherwise hang the test too
        result["r"] = client.post("/v1/completions", headers=tenant.headers,
                                  json={"model": "fake-base", "prompt": ["one", "two"], "max_tokens": 8})

    with caplog.at_level(logging.WARNING, logger=job_module.log.name):
        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        thread.join(120)
    assert not thread.is_alive(), "the request waited on an abort the engine never confirmed"
    assert result["r"].status_code >= 500
    assert len(asked) == 2  # both prompts' engine requests were asked, at once
    assert app.state.services.running == {}  # settled: the shutdown would not wait on it
    assert "ABORT_TIMEOUT_SECONDS=0.2 s" in caplog.text
    fake_engine.fail_at_step = None
    assert client.post("/v1/completions", headers=tenant.headers,
                       json={"model": "fake-base", "prompt": "one", "max_tokens": 2}).status_code == 200  # slot free


def test_a_remote_abort_waits_its_own_short_timeout_and_names_it(caplog):
    from loraplex.platform.remote import client as client_module
    from loraplex.platform.remote.client import RemoteEngine

    seen = {}

    def frozen(request):
        seen.update(request.extensions["timeout"])
        raise httpx.ReadTimeout("", request=request)

    async def run():
        engine = RemoteEngine("http://e", "s", model_name="m", max_model_len=64, tokenizer=None,
                              http=httpx.AsyncClient(transport=httpx.MockTransport(frozen)))
        return await engine.abort("r1")

    with caplog.at_level(logging.WARNING, logger=client_module.log.name):
        assert asyncio.run(run()) is None
    assert seen["read"] == client_module.ABORT_REQUEST_SECONDS  # not the generate stream's 60 s read timeout
    assert f"ABORT_REQUEST_SECONDS={client_module.ABORT_REQUEST_SECONDS:g} s" in caplog.text


def test_an_engine_process_answers_an_abort_its_step_thread_does_not_confirm(monkeypatch, caplog):
    from fake_engine import FakeEngine

    from loraplex.config import Settings
    from loraplex.platform.remote import server
    from loraplex.platform.remote.protocol import SECRET_HEADER, engine_token

    monkeypatch.setattr(server, "ENGINE_ABORT_SECONDS", 0.1)
    engine = FakeEngine()

    async def busy_step_thread(request_id):
        await asyncio.Event().wait()

    monkeypatch.setattr(engine, "abort", busy_step_thread)
    settings = Settings(environment="test", secret_key="wire-secret-0123456789")
    app = server.build_engine_app(settings, engine, advertise="http://engine")

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
            return await http.post("/engine/abort", json={"request_id": "r1"},
                                   headers={SECRET_HEADER: engine_token(settings.secret_key)})

    with caplog.at_level(logging.WARNING, logger=server.log.name):
        r = asyncio.run(run())
    assert r.status_code == 200 and r.json() == {"ok": True, "prompt_tokens_processed": None}
    assert "ENGINE_ABORT_SECONDS=0.1 s" in caplog.text

