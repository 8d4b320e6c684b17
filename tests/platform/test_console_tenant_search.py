"""The adapters page names its tenant in a text field with a few matching names, not a list of every tenant;
the field takes a typed name without the page's script, and the script's search is paged."""

from __future__ import annotations

import re

import pytest
from console_helpers import Console

from loraplex.platform.console.tenant_search import TENANT_MATCHES


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


@pytest.fixture
def many(console):
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Tenant

    with session_scope(console.app.state.services.sessions) as s:
        s.add_all([Tenant(name=f"bulk{i:03d}") for i in range(60)] + [Tenant(name="acme"), Tenant(name="acme-eu")])
    return console


def _options(page: str) -> list[str]:
    datalist = page[page.index('<datalist id="tenant-matches">'):page.index("</datalist>")]
    return re.findall(r'<option value="([^"]*)">', datalist)


def test_the_page_lists_a_few_tenants_not_all(many):
    page = many.client.get("/console/adapters").text
    assert 'name="tenant"' in page and 'data-tenant-search="/console/api/tenants"' in page
    assert "<select" not in page.split('id="adapters-tenant-form"')[1].split("</form>")[0]
    assert len(_options(page)) == TENANT_MATCHES
    assert "bulk059" not in page


def test_a_typed_name_shows_that_tenant(many):
    page = many.client.get("/console/adapters", params={"tenant": "acme"})
    assert page.status_code == 200
    assert "Upload an adapter for acme</h2>" in page.text and 'value="acme"' in page.text
    # part of one name alone is enough
    assert "Upload an adapter for bulk042" in many.client.get("/console/adapters", params={"tenant": "k042"}).text


def test_a_name_that_names_no_tenant_or_several_says_so_on_the_page(many):
    none = many.client.get("/console/adapters", params={"tenant": "nobody"})
    assert none.status_code == 404
    assert "No tenant&#39;s name holds &#39;nobody&#39;." in none.text
    assert 'id="adapters-tenant"' in none.text and 'value="nobody"' in none.text  # the field to try again
    several = many.client.get("/console/adapters", params={"tenant": "ACME-"}).text
    assert "Upload an adapter for acme-eu" in several  # case-insensitive, one match
    ambiguous = many.client.get("/console/adapters", params={"tenant": "bulk"}).text
    assert "Several tenants&#39; names hold &#39;bulk&#39;; pick one (the first ones)." in ambiguous
    assert len(re.findall(r'<a href="/console/adapters\?tenant_id=\d+">bulk', ambiguous)) == TENANT_MATCHES
    odd = many.client.get("/console/adapters", params={"tenant": "x" * 500})
    assert odd.status_code == 404 and "at most 200 characters" in odd.text


def test_the_search_is_paged_by_name(many):
    first = many.client.get("/console/api/tenants", params={"q": "BULK", "limit": "5"}).json()
    assert [t["name"] for t in first["data"]] == [f"bulk{i:03d}" for i in range(5)] and first["has_more"]
    after = many.client.get("/console/api/tenants", params={"q": "bulk", "limit": "5", "after": first["last_id"]})
    assert after.json()["data"][0]["name"] == "bulk005"
    acme = many.client.get("/console/api/tenants", params={"q": "acme"}).json()
    assert [t["name"] for t in acme["data"]] == ["acme", "acme-eu"] and not acme["has_more"]
    bad = many.client.get("/console/api/tenants", params={"limit": "0"})
    assert bad.status_code == 400 and "limit must be a whole number" in bad.text


def test_the_search_needs_a_session(client):
    assert client.get("/console/api/tenants").status_code == 401
