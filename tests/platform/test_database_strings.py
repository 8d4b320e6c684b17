"""Strings that reach the database. NUL (U+0000) in what a caller sends: PostgreSQL's text cannot hold or
compare one, so a value that would reach the database with one is refused by name (400) on every database,
instead of a 500 on PostgreSQL only. A usage record is never dropped for what PostgreSQL refuses: NUL, or a
model named by the longest adapter name and a whole content hash."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from platform_helpers import TenantKey, make_settings, postgres_schema, upload

from loraplex.platform.usage.event import UsageEvent

URLS = ["/v1/adapters/a%00b", "/v1/models/a%00b", "/v1/usage?adapter=a%00b", "/v1/usage/report?adapter=%00"]


def _chat(model="fake-base", **extra):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _check_refusals(client, tenant_headers, admin_headers, tenant_id):
    for url in URLS:
        r = client.get(url, headers=tenant_headers)
        assert r.status_code == 400 and "NUL" in r.json()["error"]["message"], (url, r.text)
        assert r.headers["x-request-id"]
    r = client.delete("/v1/adapters/a%00b", headers=tenant_headers)
    assert r.status_code == 400, r.text
    for body, param in [(_chat(model="a\x00b"), "model"), (_chat(user="end\x00user"), "user")]:
        r = client.post("/v1/chat/completions", headers=tenant_headers, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "NUL" in r.json()["error"]["message"]
    r = client.post(f"/admin/api/tenants/{tenant_id}/keys", headers=admin_headers, json={"name": "k\x00"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = client.patch(f"/admin/api/tenants/{tenant_id}", headers=admin_headers, json={"plan": "gold\x00"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "plan", r.text
    # NUL in a message's content is text for the model, not for the database: served
    r = client.post("/v1/chat/completions", headers=tenant_headers,
                    json={"model": "fake-base", "messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_nul_is_refused_by_name_on_sqlite(client, make_tenant, admin_key):
    tenant = make_tenant()
    _check_refusals(client, tenant.headers, {"Authorization": f"Bearer {admin_key}"}, tenant.tenant_id)


def test_a_usage_record_with_nul_is_kept():
    event = UsageEvent(request_id="r", tenant_id=1, api_key_id=1, model="m\x00", adapter_name=None,
                       adapter_version=None, endpoint="chat.completions", prompt_tokens=1, completion_tokens=1,
                       ttft_ms=1, latency_ms=1, status="ok", end_user="a\x00b", created_at=UsageEvent.now_iso())
    row = event.to_row()
    assert row["end_user"] == "a\ufffdb" and row["model"] == "m\ufffd" and row["tenant_id"] == 1


@pytest.fixture
def pg_url():
    with postgres_schema("lpx_strings") as url:
        yield url


@pytest.mark.integration
def test_nul_is_refused_by_name_on_postgresql_and_usage_is_stored(pg_url, tmp_path, tiny_llama_dir,
                                                                   peft_adapter_zip):
    from loraplex.platform.app import create_app
    from loraplex.platform.db import session_scope
    from loraplex.platform.migrate import upgrade_to_head
    from loraplex.platform.models import UsageRecord
    from loraplex.platform.schemas.tenants import KeyCreate, TenantCreate
    from loraplex.platform.tenants import create_admin_key, create_api_key, create_tenant
    from loraplex.platform.usage.sink import insert_events

    upgrade_to_head(pg_url)
    app = create_app(make_settings(tmp_path, model=str(tiny_llama_dir), database_url=pg_url), engine=FakeEngine())
    with TestClient(app) as client:
        services = app.state.services
        with session_scope(services.sessions) as s:
            _, admin = create_admin_key(s, services.settings)
            tenant = create_tenant(s, TenantCreate(name="acme"))
            key = create_api_key(s, services.settings, tenant, KeyCreate())
            tenant_id = tenant.id
        _check_refusals(client, {"Authorization": f"Bearer {key.key}"}, {"Authorization": f"Bearer {admin}"},
                        tenant_id)
        # the last line: an event carrying NUL is stored, not dropped
        event = UsageEvent(request_id=uuid.uuid4().hex, tenant_id=tenant_id, api_key_id=key.id, model="fake-base",
                           adapter_name=None, adapter_version=None, endpoint="chat.completions", prompt_tokens=3,
                           completion_tokens=2, ttft_ms=1, latency_ms=2, status="ok", end_user="a\x00b",
                           created_at=datetime.now(UTC).isoformat())
        assert insert_events(services.sessions, [event]) == 1
        with services.sessions() as s:
            stored = s.query(UsageRecord).filter_by(request_id=event.request_id).one()
            assert stored.end_user == "a\ufffdb" and stored.completion_tokens == 2

        # the longest adapter name with its whole content hash (129 characters) is served and billed
        tk = TenantKey(tenant_id, "acme", key.id, key.key)
        name = "n" * 64
        version = upload(client, tk, name, [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
        assert version["status"] == "ready", version
        model = f"{name}@{version['content_hash']}"
        r = client.post("/v1/chat/completions", headers=tk.headers, json=_chat(model=model))
        assert r.status_code == 200, r.text
        client.portal.call(services.usage.flush)
        with services.sessions() as s:
            stored = s.query(UsageRecord).filter_by(request_id=r.headers["x-request-id"]).one()
            assert stored.model == model and stored.adapter_version == version["content_hash"]
