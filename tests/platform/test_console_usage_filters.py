"""The usage page filters by adapter and API key as the admin usage report does, and its export takes the
page's filters and a group-by choice made on the page."""

from __future__ import annotations

import csv
import io
import re
import uuid
from datetime import UTC, datetime
from urllib.parse import urlencode

import pytest
from console_helpers import Console

from loraplex.platform.models import UsageRecord


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _record(session, tenant_id: int, key_id: int | None, adapter: str | None, prompt: int) -> None:
    session.add(UsageRecord(
        request_id=uuid.uuid4().hex, tenant_id=tenant_id, api_key_id=key_id, model=adapter or "base",
        adapter_name=adapter, adapter_version="abcdef0123456789" if adapter else None, endpoint="chat",
        prompt_tokens=prompt, completion_tokens=0, ttft_ms=1, latency_ms=1, status="ok",
        created_at=datetime.now(UTC)))


@pytest.fixture
def usage(console, make_tenant):
    """acme: 100 tokens on adapter "sql" with its first key, 20 on the base model with a second key; other: 5
    tokens on "sql"."""
    from loraplex.platform.db import session_scope
    from loraplex.platform.schemas.tenants import KeyCreate
    from loraplex.platform.tenants import create_api_key, get_tenant

    acme, other = make_tenant("acme"), make_tenant("other")
    services = console.app.state.services
    with session_scope(services.sessions) as s:
        second = create_api_key(s, services.settings, get_tenant(s, acme.tenant_id), KeyCreate(name="batch")).id
        _record(s, acme.tenant_id, acme.key_id, "sql", 100)
        _record(s, acme.tenant_id, second, None, 20)
        _record(s, other.tenant_id, other.key_id, "sql", 5)
    return acme, other, second


def _total(page: str) -> str:
    return re.search(r'<div class="label">Prompt tokens</div><div class="value">([^<]*)<', page).group(1)


def _export(console, **params) -> list[dict]:
    r = console.client.get("/console/usage/export?" + urlencode({"format": "csv", **params}, doseq=True))
    assert r.status_code == 200, r.text
    return list(csv.DictReader(io.StringIO(r.text)))


def test_the_usage_page_filters_by_adapter(console, usage):
    assert _total(console.client.get("/console/usage").text) == "125"
    page = console.client.get("/console/usage?adapter=sql").text
    assert _total(page) == "105"
    assert 'name="adapter" value="sql"' in page
    assert _total(console.client.get("/console/usage?adapter=sql@abcdef").text) == "105"
    base = console.client.get("/console/usage?adapter=base+model").text
    assert _total(base) == "20" and 'name="adapter" value="base model"' in base


def test_the_usage_page_filters_by_api_key_and_lists_the_tenants_keys(console, usage):
    acme, _other, second = usage
    page = console.client.get(f"/console/usage?tenant_id={acme.tenant_id}&api_key_id={second}").text
    assert _total(page) == "20"
    assert re.search(rf'<option value="{second}" selected>batch ', page)
    assert f'<option value="{acme.key_id}"' in page
    # a key alone names its tenant
    alone = console.client.get(f"/console/usage?api_key_id={acme.key_id}").text
    assert _total(alone) == "100" and f'<option value="{acme.tenant_id}" selected>acme' in alone


@pytest.mark.parametrize(("query", "words"), [
    ("adapter=nosuch", "There is no adapter &#39;nosuch&#39;"),
    ("adapter=sql@zz", "a version after &#39;@&#39; is at least 6 hex digits"),
    ("api_key_id=abc", "api_key_id must be an API key&#39;s numeric id"),
    ("api_key_id=99999", "There is no API key 99999"),
    ("group_by=nonsense", "group_by takes some of day, tenant, key, adapter"),
])
def test_a_filter_the_page_cannot_use_is_said_and_the_others_kept(console, usage, query, words):
    acme, _other, _second = usage
    r = console.client.get(f"/console/usage?tenant_id={acme.tenant_id}&{query}")
    assert r.status_code == 200
    assert words in r.text
    assert _total(r.text) == "120"  # still acme's usage alone, not every tenant's


def test_another_tenants_key_is_refused_not_shown_as_empty(console, usage):
    acme, other, _second = usage
    page = console.client.get(f"/console/usage?tenant_id={acme.tenant_id}&api_key_id={other.key_id}").text
    assert "is not one of the tenant&#39;s keys" in page and _total(page) == "120"
    r = console.client.get(f"/console/usage/export?tenant_id={acme.tenant_id}&api_key_id={other.key_id}&format=csv")
    assert r.status_code == 400 and "is not one of the tenant's keys" in r.text


def test_the_export_takes_the_pages_filters_and_ticked_groups(console, usage):
    acme, _other, _second = usage
    page = console.client.get(f"/console/usage?tenant_id={acme.tenant_id}&adapter=sql&group_by=key&group_by=adapter").text
    # the export buttons submit the filter form itself: every filter and ticked box goes with them
    form = page[page.index('id="usage-filters"'):page.index("</form>", page.index('id="usage-filters"'))]
    assert 'formaction="/console/usage/export"' in form and 'name="format" value="csv"' in form
    assert re.search(r'name="group_by" value="key" checked', form)
    assert re.search(r'name="group_by" value="adapter" checked', form)
    assert not re.search(r'name="group_by" value="day" checked', form)
    rows = _export(console, tenant_id=acme.tenant_id, adapter="sql", group_by=["key", "adapter"], start="", end="")
    assert [(r["adapter"], r["prompt_tokens"]) for r in rows] == [("sql@abcdef012345", "100")]
    assert "day" not in rows[0] and "key" in rows[0]
    assert [r["prompt_tokens"] for r in _export(console, adapter="base model", group_by="tenant")] == ["20"]
    default = _export(console)  # no box ticked: the default grouping, as the page shows ticked
    assert set(default[0]) >= {"day", "tenant", "adapter"}


def test_the_export_refuses_an_adapter_it_cannot_read(console, usage):
    r = console.client.get("/console/usage/export?adapter=nosuch&format=csv")
    assert r.status_code == 400 and "There is no adapter 'nosuch'" in r.text
