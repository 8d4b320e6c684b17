"""The console in headless Chromium: sign in, create a tenant and a key, upload an adapter and watch it
become ready, chat with it in the playground, and find the request in usage. Screenshots of every page go
to artifacts/screenshots/ (not committed)."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _shot(page, screenshots, name: str) -> None:
    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)


def test_operator_journey(live_console, page, screenshots):
    from playwright.sync_api import expect

    base = live_console.url
    page.goto(f"{base}/console/tenants")
    expect(page).to_have_url(re.compile(r"/console/login\?next="))
    _shot(page, screenshots, "01-login")
    page.fill("#credential", "lpx_admin_wrong")
    page.click("button[type=submit]")
    expect(page.locator(".flash.error")).to_contain_text("not a valid admin key")
    page.fill("#credential", live_console.admin_key)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{base}/console/tenants")

    page.fill("#tenant-create input[name=name]", "acme")
    page.click("#tenant-create button[type=submit]")
    expect(page.locator("h1")).to_have_text("acme")
    expect(page.locator(".flash.ok")).to_contain_text("Tenant acme created.")
    page.fill("#key-create input[name=name]", "ci")
    page.click("#key-create button[type=submit]")
    secret = page.locator("#new-key-value").inner_text()
    assert secret.startswith("lpx_") and len(secret) > 30
    _shot(page, screenshots, "02-tenant-with-new-key")
    page.goto(page.url.split("/keys")[0] if "/keys" in page.url else page.url)
    assert secret not in page.content()

    page.goto(f"{base}/console/tenants")
    expect(page.locator("table").first).to_contain_text("acme")
    _shot(page, screenshots, "03-tenants")

    page.goto(f"{base}/console/adapters")
    page.fill("#upload-form input[name=name]", "sql-helper")
    page.set_input_files("#upload-file", str(live_console.adapter_zip))
    page.click("#upload-form button[type=submit]")
    # the XHR's upload progress fills the bar before the page polls validation and reloads on "ready"
    expect(page.locator("#upload-bar")).to_have_attribute("style", re.compile(r"width: 100%"))
    expect(page.locator(".panel.adapter[data-name=sql-helper] .badge.ready").first).to_be_visible(timeout=60_000)
    _shot(page, screenshots, "04-adapters")

    page.goto(f"{base}/console/playground")
    expect(page.locator("#play-model option", has_text="sql-helper").first).to_be_attached()
    page.select_option("#play-model", "sql-helper")
    page.fill("#play-max", "12")
    page.fill("#play-input", "Write a query that counts users.")
    page.click("#play-send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".meta")).to_contain_text("completion tokens", timeout=60_000)
    assert reply.inner_text().strip()
    _shot(page, screenshots, "05-playground")

    page.goto(f"{base}/console/usage")
    table = page.locator("#usage-table")
    deadline_reloads = 20
    while "sql-helper@" not in table.inner_text() and deadline_reloads:
        page.wait_for_timeout(250)  # the usage flusher writes in batches
        page.reload()
        deadline_reloads -= 1
    expect(table).to_contain_text("acme")
    expect(table).to_contain_text("sql-helper@")
    expect(page.locator("#chart-days svg")).to_be_visible()
    _shot(page, screenshots, "06-usage")

    page.goto(f"{base}/console/billing")
    expect(page.locator("#statements")).to_contain_text("acme")
    page.fill("input[form=price-1][name=prompt]", "150")
    page.fill("input[form=price-1][name=completion]", "600")
    page.fill("input[form=price-1][name=adapter_surcharge]", "25")
    page.click("#price-1 button[type=submit]")
    expect(page.locator(".flash.ok")).to_contain_text("Prices saved, in force from")
    _shot(page, screenshots, "07-billing")
    page.locator("#statements a", has_text="View").first.click()
    expect(page.locator("table")).to_contain_text("adapter surcharge")
    amounts = [float(x) for x in page.locator("tbody td:last-child").all_inner_texts()]
    total = float(page.locator("tfoot td:last-child").inner_text())
    assert total > 0 and abs(sum(amounts) - total) < 1e-9
    _shot(page, screenshots, "08-statement")

    page.goto(f"{base}/console/dashboard")
    expect(page.locator("#dash-status")).to_contain_text("updated", timeout=10_000)
    expect(page.locator("#resident-body")).to_contain_text("sql-helper")
    expect(page.locator("#spark-tokens svg")).to_be_visible(timeout=10_000)  # a second refresh, meters settled
    _shot(page, screenshots, "09-dashboard")

    page.goto(f"{base}/console/admin-keys")
    expect(page).to_have_title("Admin keys · loraplex")
    expect(page.locator("#admin-keys")).to_contain_text("(this session's)")
    _shot(page, screenshots, "10-admin-keys")

    # one version deleted after the confirm dialog: the adapter's only one, so the adapter goes with it
    page.goto(f"{base}/console/adapters")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(".panel.adapter[data-name=sql-helper] button[aria-label^='Delete version']").first.click()
    expect(page.locator(".flash.ok")).to_contain_text("the adapter is deleted too")
    expect(page.locator(".panel.adapter[data-name=sql-helper]")).to_have_count(0)

    page.click("#logout")
    expect(page).to_have_url(f"{base}/console/login")
    page.goto(f"{base}/console/dashboard")
    expect(page).to_have_url(re.compile(r"/console/login"))
    assert not page.js_errors, page.js_errors
    assert not page.external_requests, page.external_requests
