"""The dashboard's cached adapters say which are pinned, and a pinned one is unpinned from there."""

from __future__ import annotations

import pytest
from console_helpers import Console
from platform_helpers import upload

from loraplex.engine.client import EngineStats
from loraplex.platform.models import AdapterVersion


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _cached(console) -> dict[str, dict]:
    rows = console.client.get("/console/api/dashboard").json()["adapters"]
    return {row["tenant"]: row for row in rows}


def test_the_dashboard_marks_the_pinned_version_and_unpins_it(console, make_tenant, peft_adapter_zip, fake_engine,
                                                              monkeypatch):
    a, b = make_tenant("acme"), make_tenant("beta")
    va = upload(console.client, a, "one", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    upload(console.client, b, "two", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    content = va["content_hash"]
    monkeypatch.setattr(fake_engine, "stats", lambda: EngineStats(
        lora_resident=[content], extra={"lora_pinned": sorted(fake_engine.pinned)}))
    before = _cached(console)
    assert not before["acme"]["pinned"] and not before["acme"]["engine_pinned"]

    assert console.post(f"/console/tenants/{a.tenant_id}/versions/{va['id']}/prefetch", {"pin": "1"}).status_code == 303
    pinned = _cached(console)
    assert pinned["acme"]["pinned"] and pinned["acme"]["version_id"] == va["id"]
    assert pinned["acme"]["tenant_id"] == a.tenant_id
    # beta shares the cached copy, not the pin: its row says the copy is pinned, not that beta pinned it
    assert not pinned["beta"]["pinned"] and pinned["beta"]["engine_pinned"]

    r = console.post(f"/console/tenants/{a.tenant_id}/versions/{va['id']}/prefetch", {"pin": "0", "back": "dashboard"})
    assert r.status_code == 303 and r.headers["location"] == "/console/dashboard"
    page = console.client.get(r.headers["location"]).text
    assert "is unpinned: it may be evicted again" in page
    assert not _cached(console)["acme"]["pinned"]
    with console.sessions() as s:
        assert not s.get(AdapterVersion, va["id"]).pinned
    assert fake_engine.prefetched[-1] == (content, False)


def test_an_unpin_names_no_other_place_to_go_back_to(console, make_tenant, peft_adapter_zip):
    a = make_tenant("acme")
    va = upload(console.client, a, "one", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    r = console.post(f"/console/tenants/{a.tenant_id}/versions/{va['id']}/prefetch",
                     {"pin": "0", "back": "https://elsewhere.example/"})
    assert r.headers["location"] == f"/console/adapters?tenant_id={a.tenant_id}"
