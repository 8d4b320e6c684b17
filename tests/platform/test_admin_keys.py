"""Admin keys are listed and revoked (a leaked one must stop working at once), from the admin API and the
CLI; key names carry no control characters into terminals and CSV files."""

from __future__ import annotations

from click.testing import CliRunner

from loraplex.platform.commands import admin


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_an_admin_key_revoked_over_the_api_stops_working_at_once(app, client, admin_key):
    from loraplex.platform.db import session_scope
    from loraplex.platform.tenants import create_admin_key

    with session_scope(app.state.services.sessions) as session:
        leaked, leaked_secret = create_admin_key(session, app.state.services.settings, name="leaked")
        leaked_id = leaked.id
    assert client.get("/admin/api/tenants", headers=_admin(leaked_secret)).status_code == 200
    listed = client.get("/admin/api/admin-keys", headers=_admin(admin_key)).json()
    assert {k["name"] for k in listed} >= {"admin", "leaked"}
    assert all("key" not in k and "key_hash" not in k for k in listed)
    r = client.delete(f"/admin/api/admin-keys/{leaked_id}", headers=_admin(admin_key))
    assert r.status_code == 200 and r.json()["revoked_at"]
    assert client.get("/admin/api/tenants", headers=_admin(leaked_secret)).status_code == 401
    assert client.get("/admin/api/tenants", headers=_admin(admin_key)).status_code == 200
    assert client.delete("/admin/api/admin-keys/999999", headers=_admin(admin_key)).status_code == 404


def test_the_last_active_admin_key_cannot_be_revoked_over_the_api(app, client, admin_key):
    """Revoking it would lock everyone out of the admin API and the console: a 409 saying so, the key still
    working; with another active key, it can go."""
    from loraplex.platform.db import session_scope
    from loraplex.platform.tenants import create_admin_key

    listed = client.get("/admin/api/admin-keys", headers=_admin(admin_key)).json()
    (own_id,) = [k["id"] for k in listed if k["revoked_at"] is None]
    r = client.delete(f"/admin/api/admin-keys/{own_id}", headers=_admin(admin_key))
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "conflict" and error["param"] == "key_id"
    assert "last active admin key" in error["message"] and "create-admin-key" in error["message"]
    assert client.get("/admin/api/tenants", headers=_admin(admin_key)).status_code == 200
    with session_scope(app.state.services.sessions) as session:
        _, spare_secret = create_admin_key(session, app.state.services.settings, name="spare")
    r = client.delete(f"/admin/api/admin-keys/{own_id}", headers=_admin(admin_key))
    assert r.status_code == 200 and r.json()["revoked_at"]
    spare_id = next(k["id"] for k in client.get("/admin/api/admin-keys", headers=_admin(spare_secret)).json()
                    if k["revoked_at"] is None)
    assert client.delete(f"/admin/api/admin-keys/{spare_id}", headers=_admin(spare_secret)).status_code == 409


def test_api_key_names_with_control_characters_are_refused(client, admin_key, make_tenant):
    tenant = make_tenant()
    for name in ("evil\x1b]0;pwned\x07", "line1\nline2", "tab\there"):
        r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key),
                        json={"name": name})
        assert r.status_code == 400, (name, r.text)
        assert "control characters" in r.json()["error"]["message"]
    r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key),
                    json={"name": "ünïcode ✓ ok"})
    assert r.status_code == 201


def test_the_cli_lists_and_revokes_admin_keys(elsewhere):
    cli = CliRunner()
    first = cli.invoke(admin, ["create-admin-key", "--name", "ops"])
    assert first.exit_code == 0, first.output
    listed = cli.invoke(admin, ["list-admin-keys"])
    assert listed.exit_code == 0
    (row,) = [line for line in listed.stdout.splitlines() if "\tops\t" in line]
    key_id = row.split("\t")[0]
    assert row.endswith("active")
    # the only active admin key: refused, as the admin API refuses it, unless forced
    refused = cli.invoke(admin, ["revoke-admin-key", key_id])
    assert refused.exit_code == 1 and "is the last active admin key" in refused.output, refused.output
    assert "--force" in refused.output and "Traceback" not in refused.output
    assert [line for line in cli.invoke(admin, ["list-admin-keys"]).stdout.splitlines()
            if "\tops\t" in line][0].endswith("active")
    revoked = cli.invoke(admin, ["revoke-admin-key", "--force", key_id])
    assert revoked.exit_code == 0 and "revoked" in revoked.stdout
    assert "no active admin key is left" in revoked.stderr
    (row,) = [line for line in cli.invoke(admin, ["list-admin-keys"]).stdout.splitlines() if "\tops\t" in line]
    assert "revoked" in row
    missing = cli.invoke(admin, ["revoke-admin-key", "4242"])
    assert missing.exit_code != 0 and "no admin key with id 4242" in missing.output
    assert "Traceback" not in missing.output
    bad = cli.invoke(admin, ["create-key", "acme", "--name", "a\x1bb"])
    assert bad.exit_code != 0 and "control characters" in bad.output


# bidirectional overrides and isolates make "lpx-gnp.exe" read as "lpx-exe.png"; zero-width characters and the
# byte order mark make two names that look the same differ
INVISIBLE = ("evil\u202egnp.exe", "a\u202ab", "a\u2066b\u2069", "a\u200bb", "a\u200db", "a\ufeff", "a\u2060b")


def test_key_and_tenant_names_with_invisible_characters_are_refused(client, admin_key, make_tenant, app):
    from console_helpers import Console

    tenant = make_tenant("acme")
    for name in INVISIBLE:
        r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key), json={"name": name})
        assert r.status_code == 400, (name, r.text)
        assert "bidirectional overrides or zero-width characters (found U+" in r.json()["error"]["message"]
        r = client.post("/admin/api/tenants", headers=_admin(admin_key), json={"name": f"t{name}"})
        assert r.status_code == 400, (name, r.text)
    console = Console(client=client, app=app, admin_key=admin_key)
    console.sign_in()
    for name in INVISIBLE[:2]:
        r = console.post(f"/console/tenants/{tenant.tenant_id}/keys", {"name": name})
        page = client.get(r.headers["location"]).text
        assert "No key created" in page and "zero-width characters" in page, name
        r = console.post("/console/tenants", {"name": name})
        assert "Could not create the tenant" in client.get(r.headers["location"]).text
    keys = client.get(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key))
    assert keys.status_code == 200 and len(keys.json()) == 1  # only the fixture's own key


def test_the_cli_refuses_invisible_characters_in_key_and_tenant_names(elsewhere):
    cli = CliRunner()
    assert cli.invoke(admin, ["create-tenant", "acme"]).exit_code == 0
    for name in INVISIBLE:
        for args in (["create-key", "acme", "--name", name], ["create-admin-key", "--name", name],
                     ["create-tenant", f"t{name}"]):
            r = cli.invoke(admin, args)
            assert r.exit_code != 0 and "Traceback" not in r.output, (args, r.output)
            if args[0] != "create-tenant":
                assert "zero-width characters (found U+" in r.output, (args, r.output)


def test_the_console_lists_and_revokes_admin_keys(app, client, admin_key):
    """As GET and DELETE /admin/api/admin-keys: a leaked key is revoked from the console and refused at once;
    revoking the key the console session was signed in with ends that session, saying why."""
    from console_helpers import Console

    from loraplex.platform.db import session_scope
    from loraplex.platform.tenants import create_admin_key

    with session_scope(app.state.services.sessions) as session:
        leaked, leaked_secret = create_admin_key(session, app.state.services.settings, name="<b>leaked</b>")
        leaked_id = leaked.id
    console = Console(client=client, app=app, admin_key=admin_key)
    console.sign_in()
    page = client.get("/console/admin-keys").text
    assert "<title>Admin keys · loraplex</title>" in page and 'href="/console/admin-keys"' in page
    assert "&lt;b&gt;leaked&lt;/b&gt;" in page and "<b>leaked" not in page
    assert f'action="/console/admin-keys/{leaked_id}/revoke"' in page and "(this session's)" in page

    r = console.post(f"/console/admin-keys/{leaked_id}/revoke")
    page = client.get(r.headers["location"]).text
    assert f"Admin key {leaked.prefix}… revoked" in page, page
    assert f'action="/console/admin-keys/{leaked_id}/revoke"' not in page
    assert client.get("/admin/api/tenants", headers=_admin(leaked_secret)).status_code == 401
    r = console.post("/console/admin-keys/999999/revoke")
    assert "Nothing revoked: no admin key with id 999999." in client.get(r.headers["location"]).text

    own_id = next(k["id"] for k in client.get("/admin/api/admin-keys", headers=_admin(admin_key)).json()
                  if k["revoked_at"] is None)
    r = console.post(f"/console/admin-keys/{own_id}/revoke")  # the last active one: refused
    assert "Nothing revoked: admin key" in client.get(r.headers["location"]).text
    with session_scope(app.state.services.sessions) as session:
        create_admin_key(session, app.state.services.settings, name="spare")
    r = console.post(f"/console/admin-keys/{own_id}/revoke")
    r = client.get(r.headers["location"], follow_redirects=False)
    assert r.status_code == 303 and "reason=revoked" in r.headers["location"], r.headers
