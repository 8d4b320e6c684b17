"""Cursor pagination and name search on the list endpoints: the admin API and /v1/adapters."""

from __future__ import annotations

import pytest

from loraplex.platform.db import session_scope
from loraplex.platform.models import Adapter, AdminKey, ApiKey, Plan, Tenant


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _add(app, rows) -> None:
    with session_scope(app.state.services.sessions) as session:
        session.add_all(rows)


def _walk(client, path: str, headers, limit: int, **params) -> list[dict]:
    """Every page of `path`, following last_id; checks each page's envelope on the way."""
    pages, after = [], None
    while True:
        query = {"limit": limit, **params, **({"after": after} if after is not None else {})}
        r = client.get(path, headers=headers, params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["object"] == "list"
        assert len(page["data"]) <= limit
        pages.append(page)
        if not page["has_more"]:
            return pages
        assert len(page["data"]) == limit
        after = page["last_id"]


def test_admin_tenants_walk_every_page_without_gaps_or_repeats(app, client, admin_key):
    _add(app, [Tenant(name=f"bulk{i:03d}") for i in range(250)])
    h = _admin(admin_key)
    everything = client.get("/admin/api/tenants", headers=h).json()
    assert isinstance(everything, list) and len(everything) == 250  # no paging parameter: the bare list, as before

    pages = _walk(client, "/admin/api/tenants", h, 100)
    assert [len(p["data"]) for p in pages] == [100, 100, 50]
    ids = [t["id"] for p in pages for t in p["data"]]
    assert ids == sorted(ids) == [t["id"] for t in everything]
    for p in pages:
        assert p["first_id"] == p["data"][0]["id"] and p["last_id"] == p["data"][-1]["id"]
    assert {"quotas", "plan", "status"} <= set(pages[0]["data"][0])  # the same objects as the bare list's

    # and backwards from the last page's first id
    r = client.get("/admin/api/tenants", headers=h, params={"limit": 100, "before": pages[2]["first_id"]})
    assert [t["id"] for t in r.json()["data"]] == ids[100:200] and r.json()["has_more"] is True
    r = client.get("/admin/api/tenants", headers=h, params={"limit": 100, "before": pages[1]["first_id"]})
    assert [t["id"] for t in r.json()["data"]] == ids[:100] and r.json()["has_more"] is False


def test_admin_tenants_default_limit_and_an_empty_page(app, client, admin_key):
    _add(app, [Tenant(name=f"many{i:03d}") for i in range(120)])
    h = _admin(admin_key)
    page = client.get("/admin/api/tenants", headers=h, params={"q": "many"}).json()
    assert len(page["data"]) == 100 and page["has_more"] is True
    page = client.get("/admin/api/tenants", headers=h, params={"after": 2**31 - 1}).json()
    assert page == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_search_is_case_insensitive_and_takes_like_wildcards_literally(app, client, admin_key):
    _add(app, [Tenant(name=n) for n in ("acme_corp", "ACMEXCORP", "acme-labs", "other")])
    h = _admin(admin_key)

    def names(q: str) -> list[str]:
        r = client.get("/admin/api/tenants", headers=h, params={"q": q})
        assert r.status_code == 200, r.text
        return [t["name"] for t in r.json()["data"]]

    assert names("Acme") == ["acme_corp", "ACMEXCORP", "acme-labs"]
    assert names("e_c") == ["acme_corp"]  # "_" is not "any one character"
    assert names("%") == []  # nor "%" "anything"
    assert names("\\") == []
    assert names("acme%corp") == []


def test_keys_search_by_name_or_prefix_and_page(app, client, admin_key, make_tenant):
    tenant = make_tenant("keyed")
    h = _admin(admin_key)
    created = [client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=h,
                           json={"name": f"ci-{i}" if i % 2 else f"deploy_{i}"}).json() for i in range(6)]
    path = f"/admin/api/tenants/{tenant.tenant_id}/keys"
    assert len(client.get(path, headers=h).json()) == 7  # the bare list, with make_tenant's own key
    pages = _walk(client, path, h, 2)
    assert [k["id"] for p in pages for k in p["data"]] == [tenant.key_id] + [k["id"] for k in created]
    found = client.get(path, headers=h, params={"q": "DEPLOY_"}).json()["data"]
    assert [k["name"] for k in found] == ["deploy_0", "deploy_2", "deploy_4"]
    found = client.get(path, headers=h, params={"q": created[3]["prefix"]}).json()["data"]
    assert [k["id"] for k in found] == [created[3]["id"]]


def test_plans_and_admin_keys_page(app, client, admin_key):
    _add(app, [Plan(name=f"plan{i}", requests_per_minute=1, tokens_per_minute=1, max_concurrent=1,
                    monthly_token_budget=1) for i in range(5)]
         + [AdminKey(name=f"ops{i}", prefix=f"lpxa_{i:04d}", key_hash=f"{i:064d}") for i in range(4)])
    h = _admin(admin_key)
    plans = [p["name"] for page in _walk(client, "/admin/api/plans", h, 2) for p in page["data"]]
    assert plans == [f"plan{i}" for i in range(5)]
    page = client.get("/admin/api/admin-keys", headers=h, params={"q": "OPS", "limit": 3}).json()
    assert [k["name"] for k in page["data"]] == ["ops0", "ops1", "ops2"] and page["has_more"] is True
    assert isinstance(client.get("/admin/api/admin-keys", headers=h).json(), list)


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"), ({"limit": "ten"}, "limit"), ({"limit": "-5"}, "limit"),
    ({"limit": "9" * 40}, "limit"), ({"after": "abc"}, "after"), ({"after": "0"}, "after"),
    ({"after": str(2**63)}, "after"), ({"before": "1.5"}, "before"), ({"q": "x" * 201}, "q"),
])
@pytest.mark.parametrize("path", ["/admin/api/tenants", "/admin/api/plans", "/admin/api/admin-keys",
                                  "/admin/api/adapters"])
def test_bad_paging_parameters_are_400_naming_the_parameter(client, admin_key, path, query, param):
    r = client.get(path, headers=_admin(admin_key), params=query)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


def test_tenant_adapters_walk_every_page_and_search(app, client, make_tenant):
    tenant = make_tenant("owner", scopes=["adapters"])
    other = make_tenant("neighbour")
    _add(app, [Adapter(tenant_id=tenant.tenant_id, name=f"lora-{i:03d}") for i in range(250)]
         + [Adapter(tenant_id=tenant.tenant_id, name=n) for n in ("Support_Bot", "supportxbot")]
         + [Adapter(tenant_id=other.tenant_id, name="lora-999")])
    pages = _walk(client, "/v1/adapters", tenant.headers, 100)
    names = [a["id"] for p in pages for a in p["data"]]
    assert len(names) == len(set(names)) == 252 and "lora-999" not in names  # another tenant's never shows
    assert pages[0]["first_id"] == names[0] and pages[-1]["last_id"] == names[-1]

    r = client.get("/v1/adapters", headers=tenant.headers)  # no parameters: the first 100, and has_more
    assert len(r.json()["data"]) == 100 and r.json()["has_more"] is True
    r = client.get("/v1/adapters", headers=tenant.headers, params={"q": "SUPPORT_"})
    assert [a["id"] for a in r.json()["data"]] == ["Support_Bot"]
    r = client.get("/v1/adapters", headers=tenant.headers, params={"limit": 3, "before": "lora-003"})
    assert [a["id"] for a in r.json()["data"]] == ["lora-000", "lora-001", "lora-002"]
    r = client.get("/v1/adapters", headers=tenant.headers, params={"limit": "1001"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_admin_adapters_page_by_adapter_id(app, client, admin_key, make_tenant):
    first, second = make_tenant("first"), make_tenant("second")
    _add(app, [Adapter(tenant_id=t.tenant_id, name=f"a{i}") for i in range(3) for t in (first, second)])
    h = _admin(admin_key)
    assert len(client.get("/admin/api/adapters", headers=h).json()) == 6
    pages = _walk(client, "/admin/api/adapters", h, 4)
    listed = [(a["tenant"], a["name"]) for p in pages for a in p["data"]]
    assert sorted(listed) == sorted((t, f"a{i}") for i in range(3) for t in ("first", "second"))
    assert pages[0]["last_id"] == pages[0]["data"][-1]["adapter_id"]
    page = client.get("/admin/api/adapters", headers=h, params={"q": "A1", "tenant_id": second.tenant_id}).json()
    assert [(a["tenant"], a["name"]) for a in page["data"]] == [("second", "a1")]


def test_keys_listing_is_scoped_to_the_tenant(app, client, admin_key, make_tenant):
    one, two = make_tenant("one"), make_tenant("two")
    with session_scope(app.state.services.sessions) as session:
        assert session.get(ApiKey, two.key_id) is not None
    page = client.get(f"/admin/api/tenants/{one.tenant_id}/keys", headers=_admin(admin_key),
                      params={"limit": 10}).json()
    assert [k["id"] for k in page["data"]] == [one.key_id]


def test_openapi_documents_the_paging_parameters(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/adapters", "/admin/api/tenants", "/admin/api/tenants/{tenant_id}/keys", "/admin/api/adapters"):
        params = {p["name"]: p for p in spec["paths"][path]["get"]["parameters"]}
        assert {"limit", "after", "before", "q"} <= set(params), path
        assert "1000" in params["limit"]["description"]
    assert {"first_id", "last_id", "has_more"} <= set(spec["components"]["schemas"]["AdapterList"]["properties"])
