"""An engine process answers an orchestrator's liveness (/healthz) and readiness (/readyz) probes without the
internal token, and those tell nothing else; every other endpoint still needs the token."""

from __future__ import annotations

import threading

from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from loraplex.config import Settings
from loraplex.platform.remote import server
from loraplex.platform.remote.protocol import SECRET_HEADER, engine_token


def _app(tmp_path, engine, draining=None):
    settings = Settings(environment="test", data_dir=tmp_path, secret_key="probe-secret-0123456789",
                        pin_sync_interval=3600)
    return server.build_engine_app(settings, engine, advertise="http://engine", draining=draining), settings


def test_probes_need_no_token_and_say_only_whether_the_engine_serves(tmp_path):
    engine = FakeEngine()
    draining = threading.Event()
    app, settings = _app(tmp_path, engine, draining)
    client = TestClient(app)
    # before the lifespan has started the engine: alive, not ready, and why
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json() == {"status": "not ready",
                                                 "problems": ["engine: the engine is not running yet"]}
    with client:  # the lifespan runs: the engine is started
        assert engine.started
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        h = client.get("/healthz")
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        # the internal endpoints still refuse a caller without the token, and nothing lists them
        assert client.get("/engine/info").status_code == 401
        assert client.get("/engine/stats").status_code == 401
        assert client.get("/engine/info", headers={SECRET_HEADER: engine_token(settings.secret_key)}).status_code == 200
        assert client.get("/openapi.json").status_code == 404 and client.get("/docs").status_code == 404

        draining.set()  # SIGTERM: draining
        r = client.get("/readyz")
        assert r.status_code == 503 and "stopping" in r.json()["problems"][0]
        draining.clear()

        engine.failure = "RuntimeError in its step thread (the server log has the cause)"
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["problems"] == [
            "engine: the engine stopped: RuntimeError in its step thread (the server log has the cause)"]
        assert client.get("/healthz").status_code == 200  # it still answers (and exits on its own)
        engine.failure = None
    r = client.get("/readyz")  # after the lifespan's shutdown
    assert r.status_code == 503
