"""Two first uploads of one adapter name race to create it; the loser retries and finds the adapter.
The console's upload shares that registration with the API (it used to have its own copy without it)."""

from __future__ import annotations

import pytest
from console_helpers import Console
from platform_helpers import upload
from sqlalchemy.exc import IntegrityError

import loraplex.platform.routes.adapters as adapter_routes


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


@pytest.fixture
def lose_one_race(monkeypatch):
    """The first registration fails as if another process had just inserted the same adapter name."""
    real = adapter_routes.register_upload
    calls = []

    def racing(session, scope, settings, parsed, *rest):
        calls.append(parsed)
        if len(calls) == 1:
            raise IntegrityError("INSERT INTO adapters", {}, Exception("UNIQUE constraint failed"))
        return real(session, scope, settings, parsed, *rest)

    monkeypatch.setattr(adapter_routes, "register_upload", racing)
    return calls


def test_api_upload_survives_the_race(client, make_tenant, peft_adapter_zip, lose_one_race):
    tenant = make_tenant()
    r = upload(client, tenant, "raced", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    assert len(lose_one_race) == 2


def test_console_upload_survives_the_race(console, make_tenant, peft_adapter_zip, lose_one_race):
    tenant = make_tenant("racer")
    r = console.client.post(f"/console/api/tenants/{tenant.tenant_id}/adapters", data={"name": "raced"},
                            files={"file": ("adapter.zip", peft_adapter_zip.read_bytes(), "application/zip")},
                            headers={"X-CSRF-Token": console.csrf})
    assert r.status_code == 202, r.text
    assert r.json()["name"] == "raced" and len(lose_one_race) == 2
