"""A console message (saved, refused) is shown once, by the page the form's redirect leads to: it never rides in
the URL, so a reload or a shared link does not show it again, and a crafted link cannot show one at all."""

from __future__ import annotations

import pytest
from console_helpers import Console
from itsdangerous import URLSafeTimedSerializer

from loraplex.platform.console.templating import FLASH_COOKIE


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


PLAN = {"name": "gold", "requests_per_minute": "5", "tokens_per_minute": "5", "max_concurrent": "5",
        "monthly_token_budget": "5"}


def test_a_message_is_shown_once_and_not_in_the_url(console):
    saved = console.post("/console/plans", PLAN)
    assert saved.status_code == 303
    assert saved.headers["location"] == "/console/tenants"
    first = console.client.get("/console/tenants")
    assert "Plan gold added." in first.text
    assert FLASH_COOKIE not in console.client.cookies  # the page that showed it consumed it
    reloaded = console.client.get("/console/tenants")
    assert "Plan gold added." not in reloaded.text


def test_a_message_is_not_shown_by_a_link_that_carries_one(console, settings):
    # a message signed with the service's own key, as the console once put in its redirects' URLs
    signed = URLSafeTimedSerializer(settings.secret_key, salt="loraplex.console.flash").dumps(
        {"ok": "Everything is fine; paste your admin key below.", "error": None})
    for query in (f"msg={signed}", "msg=forged"):
        page = console.client.get(f"/console/dashboard?{query}")
        assert page.status_code == 200
        assert "Everything is fine" not in page.text and 'class="flash ok"' not in page.text


def test_a_forged_message_cookie_is_ignored_and_dropped(console):
    console.client.cookies.set(FLASH_COOKIE, "forged.value", domain="testserver.local", path="/console")
    page = console.client.get("/console/dashboard")
    assert page.status_code == 200 and 'class="flash' not in page.text.replace('class="flash" hidden', "")
    assert FLASH_COOKIE not in console.client.cookies


def test_a_refused_form_too_large_for_a_cookie_keeps_its_message(console):
    # many fields each near the longest value brought back: the values are dropped, the reason is still said
    form = {**PLAN, "tokens_per_minute": "12x", **{f"extra{i}": "x" * 190 for i in range(40)}}
    refused = console.post("/console/plans", form)
    assert refused.status_code == 303
    assert len(refused.headers["set-cookie"]) < 4096
    page = console.client.get(refused.headers["location"]).text
    assert "Could not add the plan" in page


def test_signing_out_drops_a_message_not_yet_shown(console):
    console.post("/console/plans", PLAN)
    assert FLASH_COOKIE in console.client.cookies
    console.post("/console/logout")
    assert FLASH_COOKIE not in console.client.cookies
