"""/healthz says whether the process answers and whether an engine is there; /readyz is 503 until a request
could be served (an API process with no engine registered, a database that does not answer)."""

from __future__ import annotations


def test_ready_with_an_engine(client):
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert client.get("/healthz").json()["engine"] is True


def test_not_ready_without_an_engine_process(client, fake_engine, monkeypatch):
    monkeypatch.setattr(type(fake_engine), "available", False, raising=False)
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json()["engine"] is False  # alive, but nothing to serve with
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["problems"] == ["engine: No engine process is serving right now; retry shortly."]


def test_not_ready_when_the_database_does_not_answer(client, app, monkeypatch):
    def broken():
        raise ConnectionRefusedError("database down")

    monkeypatch.setattr(app.state.services, "sessions", broken)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["problems"] == ["database: ConnectionRefusedError"]


def test_not_ready_once_the_embedded_engine_has_stopped(client, fake_engine, monkeypatch, make_tenant):
    monkeypatch.setattr(fake_engine, "failure", "SystemError in its step thread (the server log has the cause)",
                        raising=False)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["problems"] == [
        "engine: The inference engine stopped: SystemError in its step thread (the server log has the cause)."]
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
