"""The console in headless Chromium: a message shown once (a reload does not bring it back), the adapters
page's tenant field filled from a search as the operator types, and a pinned adapter marked and unpinned on
the dashboard."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _sign_in(page, live_console) -> None:
    from playwright.sync_api import expect

    page.goto(f"{live_console.url}/console/login")
    page.fill("#credential", live_console.admin_key)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{live_console.url}/console/dashboard")


def test_lists_search_pins_and_one_time_messages(live_console, page):
    from playwright.sync_api import expect

    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Tenant

    base = live_console.url
    with session_scope(live_console.app.state.services.sessions) as session:
        session.add_all([Tenant(name=f"bulk{i:02d}") for i in range(30)])
    _sign_in(page, live_console)

    # a message is shown by the page after the form, and not again on reload; the URL never carries it
    page.goto(f"{base}/console/tenants")
    page.fill("#tenant-create input[name=name]", "zeta-two")
    page.click("#tenant-create button[type=submit]")
    expect(page.locator(".flash.ok")).to_contain_text("Tenant zeta-two created.")
    assert "msg=" not in page.url
    page.reload()
    expect(page.locator("h1")).to_have_text("zeta-two")
    expect(page.locator(".flash.ok")).to_have_count(0)

    # the tenant field offers at most 20 names, and the ones matching what is typed
    page.goto(f"{base}/console/adapters")
    options = page.locator("#tenant-matches option")
    expect(options).to_have_count(20)
    assert "zeta-two" not in options.evaluate_all("(os) => os.map((o) => o.value)")
    page.fill("#adapters-tenant", "")
    page.type("#adapters-tenant", "eta-t")
    expect(options).to_have_count(1)
    expect(options.first).to_have_attribute("value", "zeta-two")
    page.fill("#adapters-tenant", "zeta-two")
    page.press("#adapters-tenant", "Enter")
    expect(page.locator("h2").first).to_have_text("Upload an adapter for zeta-two")

    # pinned on the adapters page, marked and unpinned on the dashboard
    page.fill("#upload-form input[name=name]", "pinned-helper")
    page.set_input_files("#upload-file", str(live_console.adapter_zip))
    page.click("#upload-form button[type=submit]")
    ready = page.locator(".panel.adapter[data-name=pinned-helper] .badge.ready").first
    expect(ready).to_be_visible(timeout=60_000)
    page.locator(".panel.adapter[data-name=pinned-helper] button", has_text="Pin").first.click()
    expect(page.locator(".flash.ok")).to_contain_text("is pinned in the engine's cache")
    page.goto(f"{base}/console/dashboard")
    row = page.locator("#resident-body tr", has_text="pinned-helper")
    expect(row.locator(".badge.pinned")).to_have_text("pinned", timeout=10_000)
    row.get_by_role("button", name="Unpin pinned-helper of zeta-two").click()
    expect(page).to_have_url(f"{base}/console/dashboard")
    expect(page.locator(".flash.ok")).to_contain_text("unpinned: it may be evicted again")
    expect(page.locator("#resident-body tr", has_text="pinned-helper").locator(".badge.pinned")).to_have_count(
        0, timeout=10_000)
    assert re.search(r"/console/dashboard$", page.url)
    assert not page.js_errors, page.js_errors
    assert not page.external_requests, page.external_requests
