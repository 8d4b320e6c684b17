"""A console form the server refuses comes back with what the user typed in it (and the reason), not with the
stored values: a typo in one of four quotas no longer costs typing the other three again."""

from __future__ import annotations

import html
import re

import pytest
from console_helpers import Console


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _after(console: Console, path: str, data: dict) -> str:
    refused = console.post(path, data)
    assert refused.status_code == 303, refused.text
    return console.client.get(refused.headers["location"]).text


def _value(page: str, form_id: str | None, name: str) -> str:
    """The value attribute of input `name` (inside form `form_id`, or tied to it by form=)."""
    if form_id is not None:
        start = page.index(f'id="{form_id}"')
        page = page[start:page.index("</form>", start)]
    match = re.search(rf'<input[^>]*name="{name}"[^>]*value="([^"]*)"', page)
    assert match, (name, page[:2000])
    return html.unescape(match.group(1))


def test_a_refused_tenant_keeps_its_name_and_plan(console):
    assert console.post("/console/plans", {"name": "gold", "requests_per_minute": "5", "tokens_per_minute": "5",
                                           "max_concurrent": "5", "monthly_token_budget": "5"}).status_code == 303
    page = _after(console, "/console/tenants", {"name": "bad name<x>", "plan": "gold"})
    assert "Could not create the tenant: name must be 1-64 letters" in page
    assert _value(page, "tenant-create", "name") == "bad name<x>"
    assert "bad name<x>" not in page  # escaped where it is shown again
    assert re.search(r'<option value="gold" selected>', page), page


def test_a_refused_plan_keeps_every_quota_typed(console):
    sent = {"name": "pro", "requests_per_minute": "600", "tokens_per_minute": "12x", "max_concurrent": "7",
            "monthly_token_budget": "900"}
    page = _after(console, "/console/plans", sent)
    assert "Could not add the plan" in page
    for name, value in sent.items():
        assert _value(page, "plan-create", name) == value


def test_a_refused_plan_edit_keeps_its_row(console, app):
    from sqlalchemy import select

    from loraplex.platform.models import Plan

    console.post("/console/plans", {"name": "gold", "requests_per_minute": "5", "tokens_per_minute": "5",
                                    "max_concurrent": "5", "monthly_token_budget": "5"})
    with console.sessions() as s:
        plan_id = s.scalar(select(Plan.id))
    page = _after(console, f"/console/plans/{plan_id}", {"requests_per_minute": "77", "tokens_per_minute": "0",
                                                          "max_concurrent": "5", "monthly_token_budget": "5"})
    assert "Plan not saved" in page
    row = page[page.index(f'id="plan-{plan_id}"'):]
    assert _value(row, None, "requests_per_minute") == "77" and _value(row, None, "tokens_per_minute") == "0"


def test_a_refused_tenant_edit_prices_and_key_keep_what_was_typed(console):
    created = console.post("/console/tenants", {"name": "acme"})
    tenant_page = created.headers["location"].split("?")[0]
    page = _after(console, tenant_page, {"plan": "", "requests_per_minute": "123", "tokens_per_minute": "-4",
                                         "max_concurrent": "", "monthly_token_budget": ""})
    assert "Not saved" in page
    assert _value(page, "tenant-edit", "requests_per_minute") == "123"
    assert _value(page, "tenant-edit", "tokens_per_minute") == "-4"

    page = _after(console, f"{tenant_page}/prices", {"prompt": "1.5", "completion": "abc", "adapter_surcharge": ""})
    assert "Prices not saved" in page
    assert _value(page, "tenant-prices", "prompt") == "1.5" and _value(page, "tenant-prices", "completion") == "abc"

    page = _after(console, f"{tenant_page}/keys", {"name": "ci <bot>", "expires_at": "2001-01-01",
                                                   "scopes": ["inference"]})
    assert "No key created" in page
    assert _value(page, "key-create", "name") == "ci <bot>"
    assert _value(page, "key-create", "expires_at") == "2001-01-01"
    form = page[page.index('id="key-create"'):]
    form = form[:form.index("</form>")]
    assert re.search(r'value="inference"\s+checked', form) and not re.search(r'value="usage"\s+checked', form)

    # a later visit shows the stored values again
    fresh = console.client.get(tenant_page).text
    assert _value(fresh, "key-create", "name") == "default"
    assert _value(fresh, "tenant-edit", "requests_per_minute") == ""


def test_a_refused_price_list_keeps_its_row_and_period(console):
    page = console.client.get("/console/billing").text
    period = re.search(r'name="period" value="(\d{4}-\d{2})"', page).group(1)
    refused = console.post("/console/billing/prices", {"plan_id": "", "period": period, "prompt": "0.5",
                                                       "completion": "-1", "adapter_surcharge": "0", "currency": "USD"})
    assert refused.status_code == 303 and f"period={period}" in refused.headers["location"]
    page = console.client.get(refused.headers["location"]).text
    assert "Prices not saved" in page
    assert _value(page, None, "prompt") == "0.5" and _value(page, None, "completion") == "-1"


def test_a_long_typed_value_is_cut_rather_than_making_an_unusable_url(console):
    refused = console.post("/console/tenants", {"name": "x" * 100_000})
    assert refused.status_code == 303 and len(refused.headers["location"]) < 4000
    page = console.client.get(refused.headers["location"]).text
    assert "Could not create the tenant" in page
