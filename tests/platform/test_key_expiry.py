"""API keys that expire, and when each key was last used: set from the admin API, the CLI and the console,
refused with a 401 that says the key expired, listed everywhere keys are; on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from platform_helpers import admin_cli, make_settings, postgres_schema
from sqlalchemy import select, update

from loraplex.platform.models import ApiKey


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def settings(request, data_dir, tiny_llama_dir):
    if request.param == "sqlite":
        yield make_settings(data_dir, model=str(tiny_llama_dir))
        return
    from loraplex.platform.migrate import upgrade_to_head

    with postgres_schema("lpx_keys") as url:
        upgrade_to_head(url)
        yield make_settings(data_dir, model=str(tiny_llama_dir), database_url=url)


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_works_until_it_expires_then_says_so(client, app, admin_key, make_tenant):
    tenant = make_tenant()
    url = f"/admin/api/tenants/{tenant.tenant_id}/keys"
    r = client.post(url, headers=_admin(admin_key), json={"name": "ci", "expires_at": "2999-01-31"})
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["expires_at"].startswith("2999-01-31T00:00:00") and created["last_used_at"] is None
    headers = {"Authorization": f"Bearer {created['key']}"}
    assert client.get("/v1/models", headers=headers).status_code == 200

    with app.state.services.sessions() as session:  # time passes
        session.execute(update(ApiKey).where(ApiKey.id == created["id"])
                        .values(expires_at=datetime.now(UTC) - timedelta(minutes=1)))
        session.commit()
    r = client.get("/v1/models", headers=headers)
    error = r.json()["error"]
    assert r.status_code == 401 and error["code"] == "api_key_expired", r.text
    assert f"The API key {created['prefix']}... expired at " in error["message"]
    assert client.get("/v1/models", headers=tenant.headers).status_code == 200  # the tenant's other key

    for body, words in (({"expires_at": "2001-01-01T00:00:00Z"}, "has passed"),
                        ({"expires_at": "next tuesday"}, "ISO 8601"),
                        ({"expires_at": 1900000000}, "ISO 8601"),
                        # in year 10000 once in UTC: an OverflowError (a 500) before it was said in words
                        ({"expires_at": "9999-12-31T23:59:59-05:00"}, "outside the years 1 to 9999 in UTC"),
                        ({"expires_at": "0001-01-01T00:00:00+05:00"}, "outside the years 1 to 9999 in UTC")):
        r = client.post(url, headers=_admin(admin_key), json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at", r.text
        assert words in r.json()["error"]["message"], r.text
    offset = client.post(url, headers=_admin(admin_key), json={"expires_at": "2999-06-01T12:00:00+02:00"}).json()
    assert offset["expires_at"].startswith("2999-06-01T10:00:00")


def test_last_use_is_written_once_a_minute_not_per_request(client, app, admin_key, make_tenant, monkeypatch):
    services = app.state.services
    tenant = make_tenant()
    unused = make_tenant()
    writes = []
    real_write = services.key_use.write

    def counted():
        writes.append(dict(services.key_use._seen))
        return real_write()

    monkeypatch.setattr(services.key_use, "write", counted)
    for _ in range(5):
        assert client.get("/v1/models", headers=tenant.headers).status_code == 200
    with services.sessions() as session:
        assert session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == tenant.key_id)) is None
    assert services.key_use.write() == 1
    assert list(writes[-1]) == [tenant.key_id]  # five requests, one key noted once
    listed = client.get(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key)).json()
    used = datetime.fromisoformat(listed[0]["last_used_at"])
    assert abs((datetime.now(UTC) - used).total_seconds()) < 60
    assert client.get(f"/admin/api/tenants/{unused.tenant_id}/keys",
                      headers=_admin(admin_key)).json()[0]["last_used_at"] is None
    # an older use noted by another process never moves the time back
    services.key_use._seen[tenant.key_id] = used.timestamp() - 3600
    services.key_use.write()
    with services.sessions() as session:
        assert session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == tenant.key_id)) == used


def test_expiry_and_last_use_from_the_command_line(settings, monkeypatch):

    from loraplex.platform.migrate import upgrade_to_head

    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", settings.secret_key)
    upgrade_to_head(settings.resolved_database_url)
    run = admin_cli()

    run("create-tenant", "acme")
    out = run("create-key", "acme", "--name", "month", "--expires-in", "30d")
    expected = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%d")
    assert f"expires {expected}" in out
    assert "expires 2999-01-31 00:00 UTC" in run("create-key", "acme", "--expires", "2999-01-31")
    run("create-key", "acme", "--name", "forever")
    listed = run("list-keys", "acme")
    assert "\tmonth\t" in listed and f"active until {expected}" in listed
    assert "\tforever\t" in listed and "never used" in listed
    assert "expects a time from now (30d, 12h, 2w) or an ISO 8601 date" in run(
        "create-key", "acme", "--expires-in", "soon", code=2)
    assert "has passed: a key's expiry must be in the future" in run(
        "create-key", "acme", "--expires-in", "2001-01-01", code=1)


def test_expiry_and_last_use_in_the_console(settings, app, client, admin_key, make_tenant):
    import re

    from console_helpers import Console

    console = Console(client=client, app=app, admin_key=admin_key)
    console.sign_in()
    tenant = make_tenant()
    r = console.post(f"/console/tenants/{tenant.tenant_id}/keys",
                     {"name": "ci", "scopes": "inference", "expires_at": "2999-01-31"})
    page = console.client.get(r.headers["location"]).text
    assert "2999-01-31 00:00 UTC" in page and re.search(r">expired<", page) is None
    r = console.post(f"/console/tenants/{tenant.tenant_id}/keys",
                     {"name": "late", "scopes": "inference", "expires_at": "2001-01-01"})
    assert "No key created: expires at: 2001-01-01 00:00:00 UTC has passed" in console.client.get(
        r.headers["location"]).text
    with app.state.services.sessions() as session:
        session.execute(update(ApiKey).where(ApiKey.name == "ci")
                        .values(expires_at=datetime.now(UTC) - timedelta(minutes=1)))
        session.commit()
    assert ">expired<" in console.client.get(f"/console/tenants/{tenant.tenant_id}").text
