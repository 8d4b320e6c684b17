"""Console security: every route needs a session, every state change needs the session's CSRF token."""

from __future__ import annotations

import re

import pytest
from console_helpers import FORM_TOKEN, Console
from fastapi.routing import APIRoute
from sqlalchemy import func, select

from loraplex.platform.console import routes as console_routes
from loraplex.platform.db import Base
from loraplex.platform.models import ApiKey, Plan, Tenant

PUBLIC = {("GET", "/console/login"), ("POST", "/console/login"), ("GET", "/console"), ("GET", "/console/"),
          ("GET", "/console/static/{path:path}")}
SAMPLE_PARAMS = {"tenant_id": "1", "key_id": "1", "version_id": "1", "period": "2026-11", "name": "sql",
                 "path": "css/console.css", "plan_id": "1"}


def _console_routes() -> list[tuple[str, str]]:
    out = []
    for route in console_routes.router.routes:
        if isinstance(route, APIRoute):
            out.extend((m, route.path) for m in route.methods)
    for module in console_routes.PAGE_MODULES:
        for route in module.router.routes:
            if isinstance(route, APIRoute):
                out.extend((m, "/console" + route.path) for m in route.methods)
    return sorted(set(out))


def _fill(path: str) -> str:
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: SAMPLE_PARAMS[m.group(1)], path)


def _state(console: Console) -> dict:
    """Row counts of every table plus the mutable columns a console action could flip."""
    with console.sessions() as s:
        counts = {t.name: s.scalar(select(func.count()).select_from(t)) for t in Base.metadata.sorted_tables
                  if t.name not in ("console_sessions",)}
        tenants = [(t.name, t.status, t.plan_id, t.requests_per_minute) for t in s.scalars(select(Tenant))]
        keys = [(k.id, k.revoked_at) for k in s.scalars(select(ApiKey))]
        plans = [(p.name, p.requests_per_minute) for p in s.scalars(select(Plan))]
    return {"counts": counts, "tenants": tenants, "keys": keys, "plans": plans}


@pytest.fixture
def console(app, client, admin_key, make_tenant) -> Console:
    from loraplex.platform.db import session_scope
    from loraplex.platform.schemas.tenants import PlanCreate
    from loraplex.platform.tenants import create_plan

    make_tenant("acme")  # tenant 1 with key 1: targets for every action
    with session_scope(app.state.services.sessions) as session:  # plan 1, unused: a delete would go through
        create_plan(session, PlanCreate(name="spare", requests_per_minute=5, tokens_per_minute=5, max_concurrent=1,
                                        monthly_token_budget=5))
    return Console(client=client, app=app, admin_key=admin_key)


def test_the_route_list_covers_every_area():
    paths = {p for _, p in _console_routes()}
    for expected in ("/console/tenants", "/console/keys/{key_id}/revoke", "/console/usage", "/console/billing",
                     "/console/api/dashboard", "/console/logout"):
        assert expected in paths


def test_every_console_route_refuses_a_caller_without_a_session(console):
    before = _state(console)
    checked = 0
    for method, path in _console_routes():
        if (method, path) in PUBLIC:
            continue
        url = _fill(path)
        r = console.client.request(method, url, data={"csrf_token": "x", "name": "evil", "status": "suspended"},
                                   follow_redirects=False)
        assert r.status_code in (303, 401), f"{method} {url} answered {r.status_code}"
        if r.status_code == 303:
            assert r.headers["location"].startswith("/console/login")
        checked += 1
    assert checked >= 15
    assert _state(console) == before


def test_every_post_without_the_csrf_token_is_refused(console):
    console.sign_in()
    before = _state(console)
    posts = [p for m, p in _console_routes() if m == "POST" and ("POST", p) not in PUBLIC]
    assert len(posts) >= 8
    for path in posts:
        url = _fill(path)
        body = {"name": "evil", "status": "suspended", "period": "2026-10", "prompt": "1", "completion": "1",
                "adapter_surcharge": "1"}
        missing = console.client.post(url, data=body, follow_redirects=False)
        assert missing.status_code == 403, f"POST {url} without token answered {missing.status_code}"
        wrong = console.client.post(url, data={**body, "csrf_token": "not-the-token"}, follow_redirects=False)
        assert wrong.status_code == 403
        header = console.client.post(url, json={"x": 1}, headers={"X-CSRF-Token": "nope"}, follow_redirects=False)
        assert header.status_code == 403
    assert _state(console) == before


def test_a_post_from_another_site_is_refused_even_with_the_token(console):
    console.sign_in()
    r = console.client.post("/console/tenants", data={"csrf_token": console.csrf, "name": "x1"},
                            headers={"Origin": "https://evil.example"}, follow_redirects=False)
    assert r.status_code == 403
    ok = console.client.post("/console/tenants", data={"csrf_token": console.csrf, "name": "x2"},
                             headers={"Origin": "http://testserver"}, follow_redirects=False)
    assert ok.status_code == 303


def test_sign_in_needs_the_admin_key_and_its_own_csrf_token(console):
    page = console.client.get("/console/login")
    token = FORM_TOKEN.search(page.text).group(1)
    assert console.client.post("/console/login", data={"credential": console.admin_key},
                               follow_redirects=False).status_code == 403
    bad = console.client.post("/console/login", data={"csrf_token": token, "credential": "lpx_admin_wrong"},
                              follow_redirects=False)
    assert bad.status_code == 401
    assert "lpx_console" not in bad.cookies
    token = FORM_TOKEN.search(bad.text).group(1)  # a refused sign-in hands out a fresh form token
    tenant_key = console.client.post("/console/login", data={"csrf_token": token, "credential": "lpx_abc"},
                                     follow_redirects=False)
    assert tenant_key.status_code == 401


def test_a_refused_sign_in_shows_the_signed_out_layout(console):
    """A sign-in form posted without its cookie (cleared, or the page left open past its 30 minutes) is
    refused; the page says why and leads back to the sign-in page, with no menu of a console not signed in to."""
    token = FORM_TOKEN.search(console.client.get("/console/login").text).group(1)
    console.client.cookies.clear()
    r = console.client.post("/console/login", data={"csrf_token": token, "credential": console.admin_key},
                            follow_redirects=False)
    assert r.status_code == 403
    assert "reload the sign-in page and try again" in r.text
    assert 'href="/console/login"' in r.text
    for signed_in_only in ("Dashboard", "Tenants", "Sign out", "Back to the dashboard", "/console/logout"):
        assert signed_in_only not in r.text, signed_in_only
    assert "lpx_console=" not in r.headers.get("set-cookie", "")
    unknown = console.client.get("/console/no-such-page")  # any error page, for someone not signed in
    assert unknown.status_code == 404 and "Sign out" not in unknown.text and 'href="/console/login"' in unknown.text
    console.sign_in()
    signed_in = console.client.get("/console/no-such-page")
    assert "Sign out" in signed_in.text and "Back to the dashboard" in signed_in.text


def test_sign_in_pages_open_in_two_tabs_both_work(console):
    """A session that expired under several tabs sends each to the sign-in page; the one signed in from
    first must not be refused because another tab loaded the page later."""
    first = FORM_TOKEN.search(console.client.get("/console/login?next=/console/tenants").text).group(1)
    second = FORM_TOKEN.search(console.client.get("/console/login?next=/console/usage").text).group(1)
    assert second == first
    r = console.client.post("/console/login", data={"csrf_token": first, "credential": console.admin_key,
                                                    "next": "/console/tenants"},
                            headers={"Origin": "http://testserver"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants"
    console.client.cookies.clear()  # another browser: its own token
    third = FORM_TOKEN.search(console.client.get("/console/login").text).group(1)
    assert third != first


def test_session_cookie_is_httponly_strict_and_signed(console):
    page = console.client.get("/console/login")
    token = FORM_TOKEN.search(page.text).group(1)
    r = console.client.post("/console/login", data={"csrf_token": token, "credential": console.admin_key},
                            follow_redirects=False)
    cookie = [v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("lpx_console=")][0]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    console.client.cookies.clear()
    console.client.cookies.set("lpx_console", value[:-2] + ("AA" if not value.endswith("AA") else "BB"))
    assert console.client.get("/console/api/dashboard").status_code == 401
    console.client.cookies.set("lpx_console", value)
    assert console.client.get("/console/api/dashboard").status_code == 200


def test_logout_ends_the_session_everywhere(console):
    console.sign_in()
    cookie = console.client.cookies.get("lpx_console")
    r = console.post("/console/logout")
    assert r.status_code == 303
    console.client.cookies.set("lpx_console", cookie)  # a copy of the cookie kept elsewhere
    assert console.client.get("/console/api/dashboard").status_code == 401
    assert console.client.get("/console/tenants", follow_redirects=False).status_code == 303


def test_pages_carry_a_strict_content_security_policy(console):
    console.sign_in()
    r = console.client.get("/console/tenants")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert "<script>" not in r.text  # no inline script: the policy would block it


def test_sign_in_redirects_only_inside_the_console(console):
    page = console.client.get("/console/login?next=https://evil.example/")
    token = FORM_TOKEN.search(page.text).group(1)
    r = console.client.post("/console/login", data={"csrf_token": token, "credential": console.admin_key,
                                                    "next": "//evil.example/x"}, follow_redirects=False)
    assert r.headers["location"] == "/console/dashboard"


def test_dead_sessions_are_cleared_at_the_next_sign_in(console):
    from datetime import timedelta

    from loraplex.platform.console.models import ConsoleSession
    from loraplex.platform.models import utcnow

    console.sign_in()
    with console.sessions() as s:
        row = s.scalars(select(ConsoleSession)).one()
        row.expires_at = utcnow() - timedelta(seconds=1)
        s.commit()
    assert console.client.get("/console/api/dashboard").status_code == 401  # expired means signed out
    console.sign_in()
    with console.sessions() as s:
        assert s.scalar(select(func.count()).select_from(ConsoleSession)) == 1


def test_a_form_posted_after_the_session_ended_leads_to_sign_in_and_back(console):
    """The session expired while a page was open: its form's post does nothing and sends the browser to
    sign in, then back to the page it was on (not to a dead-end error page)."""
    console.sign_in()
    console.post("/console/logout")
    before = _state(console)
    r = console.client.post("/console/tenants", data={"csrf_token": "x", "name": "late"},
                            headers={"Referer": "http://testserver/console/tenants?page=2",
                                     "Origin": "http://testserver"}, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/console/login?next=/console/tenants%3Fpage%3D2&reason=unsaved"
    assert _state(console) == before
    foreign = console.client.post("/console/tenants", data={"name": "late"},
                                  headers={"Referer": "http://evil.example/console/x"}, follow_redirects=False)
    assert foreign.status_code == 303
    assert foreign.headers["location"] == "/console/login?next=/console/tenants&reason=unsaved"
    api = console.client.post("/console/api/dashboard", follow_redirects=False)
    assert api.status_code in (401, 405)


def _expire_sessions(console) -> None:
    from datetime import timedelta

    from loraplex.platform.console.models import ConsoleSession
    from loraplex.platform.models import utcnow

    with console.sessions() as s:
        for row in s.scalars(select(ConsoleSession)):
            row.expires_at = utcnow() - timedelta(seconds=1)
        s.commit()


def test_an_edit_refused_for_an_expired_session_is_said_to_be_lost(console):
    """An operator's session expired while the tenant's page was open; Save is refused. The sign-in page says
    the session expired and the change was not saved, and so does the page it returns to after signing in."""
    console.sign_in()
    _expire_sessions(console)
    r = console.client.post("/console/tenants/1", data={"csrf_token": console.csrf, "requests_per_minute": "77"},
                            headers={"Referer": "http://testserver/console/tenants/1", "Origin": "http://testserver"},
                            follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/console/login?next=/console/tenants/1&reason=unsaved"
    page = console.client.get(r.headers["location"])
    assert "Your session has expired, so the change you submitted was not saved" in page.text
    assert 'name="reason" value="unsaved"' in page.text
    token = FORM_TOKEN.search(page.text).group(1)
    bad = console.client.post("/console/login", follow_redirects=False, data={
        "csrf_token": token, "credential": "lpx_admin_wrong", "next": "/console/tenants/1", "reason": "unsaved"})
    assert bad.status_code == 401 and "was not saved" in bad.text  # a mistyped key keeps the notice
    signed_in = console.client.post("/console/login", follow_redirects=False, data={
        "csrf_token": token, "credential": console.admin_key, "next": "/console/tenants/1", "reason": "unsaved"})
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/console/tenants/1"
    back = console.client.get(signed_in.headers["location"])
    assert "The change you submitted before signing in was not saved; make it again." in back.text
    with console.sessions() as s:
        assert s.get(Tenant, 1).requests_per_minute != 77


def test_a_page_asked_for_after_expiry_says_the_session_expired(console):
    console.sign_in()
    _expire_sessions(console)
    r = console.client.get("/console/usage?start=2026-12-01", follow_redirects=False)
    assert r.headers["location"] == "/console/login?next=/console/usage%3Fstart%3D2026-12-01&reason=expired"
    page = console.client.get(r.headers["location"]).text
    assert "Your session has expired; sign in again" in page and "not saved" not in page
    token = FORM_TOKEN.search(page).group(1)
    signed_in = console.client.post("/console/login", follow_redirects=False, data={
        "csrf_token": token, "credential": console.admin_key, "next": "/console/usage", "reason": "expired"})
    assert signed_in.headers["location"] == "/console/usage"  # nothing was lost: no message to carry
    console.client.cookies.clear()  # a first visit: nothing expired
    first = console.client.get("/console/tenants", follow_redirects=False)
    assert first.headers["location"] == "/console/login?next=/console/tenants"
    assert "expired" not in console.client.get(first.headers["location"]).text
    # the page shows only its own words: a made-up reason shows nothing, and `next` is as strict as before
    made_up = console.client.get("/console/login?next=https://evil.example/&reason=<b>hi</b>").text
    assert "<b>hi" not in made_up and "&lt;b&gt;hi" not in made_up and 'name="reason" value=""' in made_up
    assert "evil.example" not in made_up and 'name="next" value="/console/dashboard"' in made_up
