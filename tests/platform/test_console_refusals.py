"""The console says what went wrong in words: a revoked admin key as revoked (not as an expired session), a
price it cannot read by name, and a failure on the server's side as a console page rather than raw JSON."""

from __future__ import annotations

import pytest
from console_helpers import Console

from loraplex.platform.db import session_scope


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _revoke_all_admin_keys(app) -> None:
    from sqlalchemy import select

    from loraplex.platform.models import AdminKey
    from loraplex.platform.tenants import revoke_admin_key

    with session_scope(app.state.services.sessions) as s:
        for key_id in s.scalars(select(AdminKey.id)).all():
            revoke_admin_key(s, key_id, allow_last=True)  # as the CLI's --force does


def test_a_revoked_admin_key_is_said_to_be_revoked(console, app, admin_key):
    client = console.client
    tenant_page = client.post("/console/tenants", data={"csrf_token": console.csrf, "name": "acme"})
    assert tenant_page.status_code == 200
    _revoke_all_admin_keys(app)
    page = client.get("/console/usage", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].endswith("&reason=revoked"), page.headers
    text = client.get(page.headers["location"]).text
    assert "has been revoked" in text and "expired" not in text
    post = console.post("/console/tenants", {"name": "beta"})
    assert post.status_code == 303 and post.headers["location"].endswith("&reason=revoked_unsaved")
    text = client.get(post.headers["location"]).text
    assert "has been revoked, so the change you submitted was not saved" in text
    api = client.get("/console/api/dashboard")
    assert api.status_code == 401 and "has been revoked" in api.json()["error"]["message"]
    # signing in again with the revoked key says so too
    login = client.get("/console/login").text
    token = login.split('name="csrf_token" value="')[1].split('"')[0]
    refused = client.post("/console/login", data={"csrf_token": token, "credential": admin_key})
    assert refused.status_code == 401 and "That admin key has been revoked" in refused.text
    # and the admin API
    r = client.get("/admin/api/tenants", headers={"Authorization": f"Bearer {admin_key}"})
    assert r.status_code == 401 and "has been revoked" in r.json()["error"]["message"]
    wrong = client.get("/admin/api/tenants", headers={"Authorization": "Bearer lpx_admin_nonsense0000000000"})
    assert wrong.status_code == 401 and "Incorrect admin key" in wrong.json()["error"]["message"]


def test_a_signed_out_session_is_not_called_revoked(console, app):
    console.post("/console/logout")
    _revoke_all_admin_keys(app)
    page = console.client.get("/console/usage", follow_redirects=False)
    assert page.status_code == 303 and "revoked" not in page.headers["location"]


@pytest.mark.parametrize("value", ["1e999999", "NaN", "Infinity", "-0", "1E3", "1_000"])
def test_prices_the_console_cannot_read_are_refused_by_name(console, value):
    console.post("/console/tenants", {"name": "acme"})
    forms = [("/console/billing/prices", {"prompt": value, "completion": "1", "adapter_surcharge": "0",
                                          "currency": "USD"}),
             ("/console/billing/prices", {"prompt": "1", "completion": "1", "adapter_surcharge": value,
                                          "currency": "USD"}),
             ("/console/tenants/1/prices", {"prompt": value, "completion": "", "adapter_surcharge": ""})]
    for path, data in forms:
        r = console.post(path, data)
        assert r.status_code == 303, (path, value, r.text)
        page = console.client.get(r.headers["location"]).text
        assert "Prices not saved" in page and ("plain decimal number" in page or "without a sign" in page), \
            (path, value)


def test_a_server_side_failure_on_a_console_page_is_a_console_page(console, monkeypatch, make_tenant):
    from loraplex.platform.console import usage_pages

    def broken(*_args, **_kwargs):
        raise RuntimeError("the report query failed")

    monkeypatch.setattr(usage_pages, "usage_report", broken)
    r = console.client.get("/console/usage")
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("text/html"), r.headers
    assert "Something went wrong" in r.text and r.headers["x-request-id"] in r.text
    assert "Back to the dashboard" in r.text  # the signed-in console's page, with its menu
    assert "the report query failed" not in r.text  # the cause is for the server log
    # the API stays JSON
    monkeypatch.setattr("loraplex.platform.billing.routes.usage_report", broken)
    api = console.client.get("/v1/usage/report", headers=make_tenant().headers)
    assert api.status_code == 500 and api.headers["content-type"].startswith("application/json")
    assert api.json()["error"]["type"] == "server_error"
