"""The plans table and the admin keys page are paged like the other console lists: a search box and
Previous/Next links; the plans' parameters are their own beside the tenants list on the same page."""

from __future__ import annotations

import html
import re

import pytest
from console_helpers import Console

from loraplex.platform.db import session_scope
from loraplex.platform.models import AdminKey, Plan, Tenant


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _add(app, rows) -> None:
    with session_scope(app.state.services.sessions) as session:
        session.add_all(rows)


def _plan(name: str) -> Plan:
    return Plan(name=name, requests_per_minute=1, tokens_per_minute=1, max_concurrent=1, monthly_token_budget=1)


def _links(page: str, rel: str) -> list[str]:
    return [html.unescape(u) for u in re.findall(rf'<a href="([^"]+)" rel="{rel}"', page)]


def _plan_names(page: str) -> list[str]:
    table = page[page.index('<table id="plans">'):]
    table = table[:table.index("</table>")]
    return re.findall(r'aria-label="Name of plan ([^"]+)"', table)


def test_the_plans_table_walks_its_pages_apart_from_the_tenants_list(app, console):
    _add(app, [_plan(f"plan{i:03d}") for i in range(120)] + [Tenant(name=f"t{i:03d}") for i in range(120)])
    first = console.client.get("/console/tenants")
    assert len(_plan_names(first.text)) == 100 and _plan_names(first.text)[0] == "plan000"
    following = [u for u in _links(first.text, "next") if "plans_after=" in u]
    assert len(following) == 1 and "after=" not in following[0].replace("plans_after=", "")
    second = console.client.get(following[0])
    assert _plan_names(second.text) == [f"plan{i:03d}" for i in range(100, 120)]
    # the tenants list stays on its first page
    assert re.search(r'<a href="/console/tenants/\d+">t000</a>', second.text)
    back = [u for u in _links(second.text, "prev") if "plans_before=" in u]
    assert _plan_names(console.client.get(back[0]).text)[0] == "plan000"

    found = console.client.get("/console/tenants", params={"plans_q": "PLAN11", "q": "t00"})
    assert _plan_names(found.text) == [f"plan11{i}" for i in range(10)]
    assert 'name="plans_q" value="PLAN11"' in found.text
    assert re.search(r'<a href="/console/tenants/\d+">t009</a>', found.text)
    assert not re.search(r'<a href="/console/tenants/\d+">t010</a>', found.text)
    none = console.client.get("/console/tenants", params={"plans_q": "nosuch"}).text
    assert "No plan's name contains" in none


def test_a_bad_plans_page_parameter_is_a_readable_400_naming_it(console):
    page = console.client.get("/console/tenants", params={"plans_limit": "0"})
    assert page.status_code == 400 and "plans_limit must be a whole number" in page.text


def test_a_plan_saved_on_a_later_page_comes_back_to_that_page(app, console):
    _add(app, [_plan(f"plan{i:03d}") for i in range(120)])
    with console.sessions() as s:
        plan_id = s.scalar(Plan.__table__.select().with_only_columns(Plan.id).where(Plan.name == "plan110"))
    referer = "http://testserver/console/tenants?plans_after=plan099"
    fields = {"name": "plan110", "requests_per_minute": "7", "tokens_per_minute": "x7", "max_concurrent": "7",
              "monthly_token_budget": "7"}
    refused = console.post(f"/console/plans/{plan_id}", fields, headers={"Referer": referer})
    assert refused.headers["location"] == "/console/tenants?plans_after=plan099"
    page = console.client.get(refused.headers["location"]).text
    assert "Plan not saved" in page and 'value="x7"' in page  # the row, with what was typed, is on this page
    # a post from another page (or with a referer the browser left out) goes back to the plans' first page
    elsewhere = console.post(f"/console/plans/{plan_id}", fields,
                             headers={"Referer": "http://testserver/console/dashboard?plans_after=plan099"})
    assert elsewhere.headers["location"] == "/console/tenants"


def _key_prefixes(page: str) -> list[str]:
    return re.findall(r'<td class="mono">(lpx_admin_k\d+)…</td>', page)


def test_the_admin_keys_page_is_paged_and_searched(app, console):
    _add(app, [AdminKey(name=f"ops-{i}", prefix=f"lpx_admin_k{i:03d}", key_hash=f"{i:064d}") for i in range(130)])
    first = console.client.get("/console/admin-keys").text
    assert 'name="q"' in first
    shown = _key_prefixes(first)
    following = _links(first, "next")
    assert following and len(shown) < 131
    second = console.client.get(following[0]).text
    assert not set(_key_prefixes(second)) & set(shown)
    assert len(set(shown) | set(_key_prefixes(second))) == 130
    found = console.client.get("/console/admin-keys", params={"q": "K12"}).text
    assert _key_prefixes(found) == [f"lpx_admin_k12{i}" for i in range(10)]
    assert "(this session&#39;s)" not in found and "(this session's)" not in found
    # the last-key warning counts every active key, not the page's
    assert "It is the last active admin key" not in found
    assert "No admin key's name or prefix contains" in console.client.get(
        "/console/admin-keys", params={"q": "nosuch"}).text
