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


class _Redis:
    def __init__(self, error: BaseException | None = None, delay: float = 0.0):
        self.error, self.delay, self.pings = error, delay, 0

    async def ping(self) -> bool:
        import asyncio

        self.pings += 1
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return True


def test_ready_only_while_redis_answers(client, app, monkeypatch):
    """With Redis configured, quotas and usage need it: /readyz says which dependency failed."""
    import redis.exceptions

    from loraplex.platform.routes import health

    services = app.state.services
    monkeypatch.setattr(services, "redis", _Redis())
    assert client.get("/readyz").status_code == 200 and services.redis.pings == 1
    monkeypatch.setattr(services, "redis", _Redis(redis.exceptions.ConnectionError("Connection refused")))
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["problems"] == ["redis: ConnectionError"]
    monkeypatch.setattr(health, "REDIS_PING_SECONDS", 0.05)
    monkeypatch.setattr(services, "redis", _Redis(delay=5))
    r = client.get("/readyz")
    # said to operators in words, not by the name of a constant in the code they cannot set
    assert r.status_code == 503 and r.json()["problems"] == [
        "redis: no answer to a ping within 0.05 s (the readiness check's limit)"]
