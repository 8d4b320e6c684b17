"""Console lists a page at a time: search boxes and Previous/Next links that keep the search."""

from __future__ import annotations

import html
import re

import pytest
from console_helpers import Console

from loraplex.platform.db import session_scope
from loraplex.platform.models import Adapter, ApiKey, Tenant


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _add(app, rows) -> None:
    with session_scope(app.state.services.sessions) as session:
        session.add_all(rows)


def _link(page: str, rel: str) -> str | None:
    found = re.search(rf'<a href="([^"]+)" rel="{rel}"', page)
    return html.unescape(found.group(1)) if found else None


def _tenant_names(page: str) -> list[str]:
    return re.findall(r'<td><a href="/console/tenants/\d+">([^<]+)</a></td>', page)


def test_tenants_page_walks_pages_forth_and_back_keeping_the_search(app, console):
    _add(app, [Tenant(name=f"shop_{i:03d}") for i in range(130)] + [Tenant(name=f"shopx{i:03d}") for i in range(5)])
    first = console.client.get("/console/tenants", params={"q": "SHOP_", "limit": "50"})
    assert first.status_code == 200
    assert 'name="q" value="SHOP_"' in first.text
    assert _tenant_names(first.text) == [f"shop_{i:03d}" for i in range(50)]
    assert _link(first.text, "prev") is None

    seen, page = [], first
    while True:
        seen += _tenant_names(page.text)
        following = _link(page.text, "next")
        if following is None:
            break
        assert "q=SHOP_" in following and "limit=50" in following
        page = console.client.get(following)
        assert page.status_code == 200
    assert seen == [f"shop_{i:03d}" for i in range(130)]  # "_" matched itself: no shopx rows, no gaps or repeats

    back = console.client.get(_link(page.text, "prev"))
    assert _tenant_names(back.text) == [f"shop_{i:03d}" for i in range(50, 100)]
    assert _link(back.text, "next") and _link(back.text, "prev")


def test_tenant_page_keys_and_adapters_page_search(app, console, make_tenant):
    tenant = make_tenant("owner")
    _add(app, [ApiKey(tenant_id=tenant.tenant_id, name=f"ci-{i}", prefix=f"lpx_ci{i:04d}", key_hash=f"{i:064d}",
                      scopes="inference") for i in range(3)]
         + [Adapter(tenant_id=tenant.tenant_id, name=n) for n in ("sql-helper", "support_bot", "supportxbot")])
    page = console.client.get(f"/console/tenants/{tenant.tenant_id}", params={"q": "CI-", "limit": "2"})
    assert page.status_code == 200
    assert re.findall(r'<td class="mono">(lpx_ci\d+)…</td>', page.text) == ["lpx_ci0002", "lpx_ci0001"]  # newest first
    older = console.client.get(_link(page.text, "next"))
    assert re.findall(r'<td class="mono">(lpx_ci\d+)…</td>', older.text) == ["lpx_ci0000"]

    page = console.client.get("/console/adapters", params={"tenant_id": tenant.tenant_id, "q": "t_b"})
    assert page.status_code == 200
    assert re.findall(r'data-name="([^"]+)"', page.text) == ["support_bot"]


@pytest.mark.parametrize(("query", "param"), [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                                            ({"q": "y" * 300}, "q")])
def test_bad_page_parameters_are_a_readable_400_page(console, query, param):
    page = console.client.get("/console/tenants", params=query)
    assert page.status_code == 400
    assert "text/html" in page.headers["content-type"]
    assert "The page address is not valid" in page.text and param in page.text
