"""The admin API: plans, tenants, keys; shown-once secrets; immediate revocation."""

from __future__ import annotations

import pytest


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_admin_api_needs_the_admin_key(client, make_tenant):
    tenant = make_tenant()
    r = client.get("/admin/api/tenants")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["x-request-id"].startswith("req_")
    r = client.get("/admin/api/tenants", headers=tenant.headers)
    assert r.status_code == 401
    assert "admin key" in r.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [("post", "/v1/chat/completions"), ("get", "/v1/models"),
                                            ("get", "/v1/adapters"), ("get", "/v1/usage")])
def test_tenant_routes_tell_the_admin_key_it_is_the_wrong_key(client, admin_key, method, path):
    """The other way round from the admin API's refusal of a tenant key: not "Incorrect API key", which reads as
    a typo in a key that is in fact right for the admin API."""
    r = getattr(client, method)(path, headers=_admin(admin_key))
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "needs a tenant's API key, not the admin key" in error["message"], error
    assert admin_key[12:] not in error["message"]


def test_create_tenant_plan_and_key(client, admin_key):
    h = _admin(admin_key)
    r = client.post("/admin/api/plans", headers=h, json={
        "name": "pro", "requests_per_minute": 100, "tokens_per_minute": 1000, "max_concurrent": 4,
        "monthly_token_budget": 10**6})
    assert r.status_code == 201, r.text
    r = client.post("/admin/api/tenants", headers=h, json={"name": "acme", "plan": "pro", "max_concurrent": 2})
    assert r.status_code == 201, r.text
    tenant = r.json()
    assert tenant["quotas"] == {"requests_per_minute": 100, "tokens_per_minute": 1000, "max_concurrent": 2,
                                "monthly_token_budget": 10**6}
    r = client.post("/admin/api/tenants", headers=h, json={"name": "acme"})
    assert r.status_code == 409
    assert "already exists" in r.json()["error"]["message"]
    r = client.post("/admin/api/tenants", headers=h, json={"name": "other", "plan": "nope"})
    assert r.status_code == 400 and "unknown plan" in r.json()["error"]["message"]

    r = client.post(f"/admin/api/tenants/{tenant['id']}/keys", headers=h, json={"scopes": ["inference"]})
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["key"].startswith("lpx_") and created["key"].startswith(created["prefix"])
    listed = client.get(f"/admin/api/tenants/{tenant['id']}/keys", headers=h).json()
    assert [k["id"] for k in listed] == [created["id"]]
    assert "key" not in listed[0]

    r = client.patch(f"/admin/api/tenants/{tenant['id']}", headers=h, json={"max_concurrent": None})
    assert r.json()["quotas"]["max_concurrent"] == 4


def test_key_validation_errors_are_400_with_param(client, admin_key, make_tenant):
    tenant = make_tenant()
    r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key),
                    json={"scopes": ["root"]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "scopes" and "unknown scope" in err["message"]


def test_revoked_key_is_refused_at_once(client, admin_key, make_tenant):
    tenant = make_tenant()
    assert client.get("/v1/models", headers=tenant.headers).status_code == 200
    r = client.delete(f"/admin/api/keys/{tenant.key_id}", headers=_admin(admin_key))
    assert r.status_code == 200 and r.json()["revoked_at"]
    r = client.get("/v1/models", headers=tenant.headers)
    assert r.status_code == 401
    assert "revoked" in r.json()["error"]["message"]


def test_suspended_tenant_gets_403(client, admin_key, make_tenant):
    tenant = make_tenant()
    client.patch(f"/admin/api/tenants/{tenant.tenant_id}", headers=_admin(admin_key), json={"status": "suspended"})
    r = client.get("/v1/models", headers=tenant.headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_suspended"


def test_out_of_range_quota_is_400(client, admin_key):
    r = client.post("/admin/api/tenants", headers=_admin(admin_key),
                    json={"name": "huge", "requests_per_minute": 10**12})
    assert r.status_code == 400 and r.json()["error"]["param"] == "requests_per_minute"


def test_out_of_range_ids_are_4xx(client, admin_key):
    for path in ("/admin/api/tenants/99999999999999999999", "/admin/api/tenants/0/keys"):
        r = client.get(path, headers=_admin(admin_key))
        assert r.status_code == 400, r.text
    assert client.get("/admin/api/tenants/12345", headers=_admin(admin_key)).status_code == 404


PRO = {"name": "pro", "requests_per_minute": 100, "tokens_per_minute": 100000, "max_concurrent": 4,
       "monthly_token_budget": 10**6}


def _chat_limit(client, headers) -> str:
    r = client.post("/v1/chat/completions", headers=headers,
                    json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-ratelimit-limit-requests"]


def test_a_plan_edit_reaches_its_tenants_next_request_unless_they_override(client, admin_key, make_tenant):
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Plan, Tenant

    h = _admin(admin_key)
    plan = client.post("/admin/api/plans", headers=h, json=PRO).json()
    on_plan, own = make_tenant(), make_tenant(requests_per_minute=50)
    with session_scope(client.app.state.services.sessions) as session:
        for t in (on_plan, own):
            session.get(Tenant, t.tenant_id).plan = session.get(Plan, plan["id"])
    assert _chat_limit(client, on_plan.headers) == "100" and _chat_limit(client, own.headers) == "50"

    r = client.patch(f"/admin/api/plans/{plan['id']}", headers=h, json={"requests_per_minute": 7, "name": "pro2"})
    assert r.status_code == 200, r.text
    assert r.json()["requests_per_minute"] == 7 and r.json()["name"] == "pro2"
    assert r.json()["tokens_per_minute"] == 100000  # left out: kept
    assert _chat_limit(client, on_plan.headers) == "7" and _chat_limit(client, own.headers) == "50"
    assert client.get(f"/admin/api/tenants/{on_plan.tenant_id}", headers=h).json()["quotas"]["requests_per_minute"] == 7


def test_a_plan_edit_is_strict_and_names_stay_unique(client, admin_key):
    h = _admin(admin_key)
    plan = client.post("/admin/api/plans", headers=h, json=PRO).json()
    client.post("/admin/api/plans", headers=h, json={**PRO, "name": "basic"})
    for body, param in [({"requests_per_minute": "600"}, "requests_per_minute"), ({"rpm": 5}, "rpm"),
                        ({"max_concurrent": None}, "max_concurrent"), ({"monthly_token_budget": 2**63}, None),
                        ({"name": "bad name"}, "name")]:
        r = client.patch(f"/admin/api/plans/{plan['id']}", headers=h, json=body)
        assert r.status_code == 400, (body, r.text)
        assert param is None or r.json()["error"]["param"] == param, (body, r.text)
    r = client.patch(f"/admin/api/plans/{plan['id']}", headers=h, json={"name": "basic"})
    assert r.status_code == 409 and "already exists" in r.json()["error"]["message"]
    assert client.patch("/admin/api/plans/999", headers=h, json={}).status_code == 404
    assert client.patch(f"/admin/api/plans/{plan['id']}", headers=h, json={"name": "pro"}).status_code == 200
    assert client.patch(f"/admin/api/plans/{plan['id']}", headers={}, json={}).status_code == 401


def test_a_plan_is_deleted_only_when_no_tenant_is_on_it_nor_its_history_names_it(client, admin_key):
    h = _admin(admin_key)
    used = client.post("/admin/api/plans", headers=h, json=PRO).json()
    unused = client.post("/admin/api/plans", headers=h, json={**PRO, "name": "spare"}).json()
    r = client.put(f"/admin/api/billing/prices/plans/{unused['id']}", headers=h,
                   json={"prompt_price": 1, "completion_price": 1, "adapter_surcharge_price": 0})
    assert r.status_code == 200, r.text  # its price list goes with it
    tenant = client.post("/admin/api/tenants", headers=h, json={"name": "acme", "plan": "pro"}).json()
    client.post("/admin/api/tenants", headers=h, json={"name": "beta", "plan": "pro"})

    r = client.delete(f"/admin/api/plans/{used['id']}", headers=h)
    assert r.status_code == 409, r.text
    assert "has 2 tenant(s): acme, beta" in r.json()["error"]["message"]
    for name in ("acme", "beta"):  # off the plan, which their history still names as the one they began on
        client.patch(f"/admin/api/tenants/{tenant['id'] if name == 'acme' else tenant['id'] + 1}", headers=h,
                     json={"plan": None})
    r = client.delete(f"/admin/api/plans/{used['id']}", headers=h)
    assert r.status_code == 409 and "plan history of 2 tenant(s): acme, beta" in r.json()["error"]["message"]

    r = client.delete(f"/admin/api/plans/{unused['id']}", headers=h)
    assert r.status_code == 200 and r.json()["name"] == "spare"
    assert [p["name"] for p in client.get("/admin/api/plans", headers=h).json()] == ["pro"]
    assert client.delete(f"/admin/api/plans/{unused['id']}", headers=h).status_code == 404


def test_a_plan_joined_and_left_within_one_month_prices_nothing_and_may_be_deleted(client, admin_key):
    """A plan change applies to the whole month it is made in: a tenant moved onto a plan and off it again in
    one month is billed that month at the plan it ended on, and no month of its history names the plan, so
    deleting the plan changes no statement and is allowed; a plan that priced one of its months is kept."""
    from loraplex.platform.billing.prices import plan_of, price_for_tenant
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Tenant

    h = _admin(admin_key)
    basic = client.post("/admin/api/plans", headers=h, json={**PRO, "name": "basic"}).json()
    brief = client.post("/admin/api/plans", headers=h, json={**PRO, "name": "brief"}).json()
    for plan, price in ((basic, 10), (brief, 99)):
        r = client.put(f"/admin/api/billing/prices/plans/{plan['id']}", headers=h,
                       json={"prompt_price": price, "completion_price": price, "adapter_surcharge_price": 0})
        assert r.status_code == 200, r.text
    tenant = client.post("/admin/api/tenants", headers=h, json={"name": "acme", "plan": "basic"}).json()
    for plan in ("brief", "basic"):  # onto `brief` and back, this month
        r = client.patch(f"/admin/api/tenants/{tenant['id']}", headers=h, json={"plan": plan})
        assert r.status_code == 200, r.text

    def this_month():
        with session_scope(client.app.state.services.sessions) as session:
            acme = session.get(Tenant, tenant["id"])
            return plan_of(session, acme), price_for_tenant(session, acme)

    before = this_month()
    assert before[0] == basic["id"] and before[1].prompt == 10  # the month is priced at the plan it ended on
    r = client.delete(f"/admin/api/plans/{brief['id']}", headers=h)
    assert r.status_code == 200 and r.json()["name"] == "brief", r.text
    assert this_month() == before  # the month's price did not change with the delete
    r = client.delete(f"/admin/api/plans/{basic['id']}", headers=h)  # the plan of this month is kept
    assert r.status_code == 409, r.text


def test_tenant_and_plan_names_are_unique_whatever_their_case(client, admin_key, app):
    """`acme` and `ACME` would read as one tenant to whoever types the name: the second is refused, by the
    service (naming the one that exists) and, behind it, by the database's unique index on lower(name)."""
    import pytest
    from sqlalchemy.exc import IntegrityError

    from loraplex.platform.models import Plan, Tenant

    h = _admin(admin_key)
    assert client.post("/admin/api/tenants", headers=h, json={"name": "acme"}).status_code == 201
    r = client.post("/admin/api/tenants", headers=h, json={"name": "ACME"})
    assert r.status_code == 409 and r.json()["error"]["param"] == "name"
    message = r.json()["error"]["message"]
    assert "'acme' already exists" in message and "whatever their case" in message and "'ACME'" in message
    pro = client.post("/admin/api/plans", headers=h, json=PRO).json()
    basic = client.post("/admin/api/plans", headers=h, json={**PRO, "name": "basic"}).json()
    r = client.post("/admin/api/plans", headers=h, json={**PRO, "name": "Pro"})
    assert r.status_code == 409 and "'pro' already exists" in r.json()["error"]["message"]
    r = client.patch(f"/admin/api/plans/{basic['id']}", headers=h, json={"name": "PRO"})
    assert r.status_code == 409 and "whatever their case" in r.json()["error"]["message"]
    r = client.patch(f"/admin/api/plans/{pro['id']}", headers=h, json={"name": "PRO"})  # its own name, recased
    assert r.status_code == 200 and r.json()["name"] == "PRO"
    for row in (Tenant(name="Acme"), Plan(name="basIC", requests_per_minute=1, tokens_per_minute=1,
                                          max_concurrent=1, monthly_token_budget=1)):
        with app.state.services.sessions() as session, pytest.raises(IntegrityError):
            session.add(row)
            session.flush()
