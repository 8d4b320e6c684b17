"""A tenant's plan is kept by month: a plan change re-prices neither earlier months nor billed ones."""

from __future__ import annotations

import calendar
import uuid
from datetime import UTC, datetime, timedelta

from loraplex.platform.billing.models import TenantPlan
from loraplex.platform.billing.periods import period_of, previous_period, today_utc
from loraplex.platform.db import session_scope
from loraplex.platform.models import UsageRecord

PLAN = {"requests_per_minute": 100, "tokens_per_minute": 100_000, "max_concurrent": 4,
        "monthly_token_budget": 10_000_000}


def _admin(admin_key):
    return {"Authorization": f"Bearer {admin_key}"}


def _setup(app, client, h):
    """Plans basic (USD) and pro (EUR) priced since last month; tenant "hist" on basic with a key and usage
    last month and this month."""
    last = previous_period(today_utc())
    ids = {}
    for name, currency, prompt in (("basic", "USD", 1_000_000), ("pro", "EUR", 10_000_000)):
        r = client.post("/admin/api/plans", headers=h, json={"name": name, **PLAN})
        assert r.status_code == 201, r.text
        ids[name] = r.json()["id"]
        r = client.put(f"/admin/api/billing/prices/plans/{ids[name]}", headers=h, json={
            "prompt_price": prompt, "completion_price": 2 * prompt, "adapter_surcharge_price": 0,
            "currency": currency, "effective_period": last})
        assert r.status_code == 200, r.text
    r = client.post("/admin/api/tenants", headers=h, json={"name": "hist", "plan": "basic"})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    key = client.post(f"/admin/api/tenants/{tenant_id}/keys", headers=h, json={"name": "k"}).json()
    now = datetime.now(UTC).replace(microsecond=0)
    last_month = now.replace(day=1) - timedelta(days=3)
    with session_scope(app.state.services.sessions) as s:
        for at in (last_month, now):
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant_id, api_key_id=key["id"], model="base",
                              adapter_name=None, adapter_version=None, endpoint="chat", prompt_tokens=3000,
                              completion_tokens=1500, ttft_ms=1, latency_ms=10, status="ok", created_at=at))
    return tenant_id, {"Authorization": f"Bearer {key['key']}"}, last


def _statement(client, headers, period):
    body = client.get(f"/v1/billing/statements/{period}", headers=headers).json()
    return body["currency"], body["total_amount"]


def _report(client, h, period):
    year, month = map(int, period.split("-"))
    first, end = f"{period}-01", f"{period}-{calendar.monthrange(year, month)[1]}"
    row, = client.get(f"/admin/api/billing/report?start={first}&end={end}&group_by=tenant", headers=h).json()["data"]
    return row["currency"], row["amount"]


def test_a_plan_change_applies_from_its_month_on(app, client, admin_key):
    h = _admin(admin_key)
    tenant_id, tenant, last = _setup(app, client, h)
    this = period_of(today_utc())
    basic = ("USD", 3000 * 1 + 1500 * 2)  # micro-units: 3000 prompt tokens at 1.0 per million, ...
    pro = ("EUR", 3000 * 10 + 1500 * 20)
    assert _statement(client, tenant, last) == basic and _statement(client, tenant, this) == basic

    r = client.patch(f"/admin/api/tenants/{tenant_id}", headers=h, json={"plan": "pro"})
    assert r.status_code == 200 and r.json()["plan"] == "pro", r.text
    # the month of the change is priced at the new plan, the month before keeps its plan and currency
    assert _statement(client, tenant, this) == pro
    assert _statement(client, tenant, last) == basic
    assert _report(client, h, last) == basic

    # once last month is final, neither its statement nor its report moves with later changes
    assert client.post("/admin/api/billing/statements/finalize", headers=h, json={"period": last}).status_code == 200
    for plan in ("basic", "pro", None):
        assert client.patch(f"/admin/api/tenants/{tenant_id}", headers=h, json={"plan": plan}).status_code == 200
        assert _statement(client, tenant, last) == basic and _report(client, h, last) == basic
    # no plan this month: the no-plan list (none set: nothing to pay)
    assert _statement(client, tenant, this)[1] == 0
    with session_scope(app.state.services.sessions) as s:
        rows = s.query(TenantPlan).filter_by(tenant_id=tenant_id).order_by(TenantPlan.effective_period).all()
        # one row for every month before, one for this month, however often it changed
        assert [(r.effective_period, r.plan_id is None) for r in rows] == [("2000-01", False), (this, True)]


def test_tenants_made_before_plan_history_keep_their_plan_for_earlier_months(app, client, admin_key):
    """A tenant with no history rows (made before the table existed) is on its current plan until a change."""
    h = _admin(admin_key)
    tenant_id, tenant, last = _setup(app, client, h)
    with session_scope(app.state.services.sessions) as s:
        s.query(TenantPlan).filter_by(tenant_id=tenant_id).delete()
    assert client.patch(f"/admin/api/tenants/{tenant_id}", headers=h, json={"plan": "pro"}).status_code == 200
    assert _statement(client, tenant, last)[0] == "USD"
    assert _statement(client, tenant, period_of(today_utc()))[0] == "EUR"


def test_no_statement_for_a_month_before_the_tenant_existed(client, make_tenant):
    tenant = make_tenant()
    this, last = period_of(today_utc()), previous_period(today_utc())
    listing = client.get("/v1/billing/statements", headers=tenant.headers).json()["data"]
    assert [s["period"] for s in listing] == [this]
    r = client.get(f"/v1/billing/statements/{last}", headers=tenant.headers)
    assert r.status_code == 404 and r.json()["error"]["param"] == "period", r.text
    assert client.get(f"/v1/billing/statements/{this}", headers=tenant.headers).status_code == 200
    future = f"{int(this[:4]) + 1}{this[4:]}"
    r = client.get(f"/v1/billing/statements/{future}", headers=tenant.headers)
    assert r.status_code == 404 and "has not begun" in r.json()["error"]["message"], r.text


def test_admin_views_have_no_statement_where_the_tenant_api_has_none(client, admin_key, make_tenant):
    """The admin API, the admin list and the console say "no statement" for the months the tenant API does:
    one that has not begun and one before the tenant existed (they used to show an empty draft)."""
    from console_helpers import Console

    h = _admin(admin_key)
    tenant = make_tenant()
    this, last = period_of(today_utc()), previous_period(today_utc())
    future = f"{int(this[:4]) + 1}{this[4:]}"
    for period, words in ((future, "has not begun"), (last, "did not exist then")):
        r = client.get(f"/admin/api/billing/statements/{tenant.tenant_id}/{period}", headers=h)
        assert r.status_code == 404 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "period"
        listing = client.get("/admin/api/billing/statements", headers=h,
                             params={"period": period, "tenant_id": tenant.tenant_id})
        assert listing.status_code == 200 and listing.json()["data"] == [], listing.text
    r = client.get(f"/admin/api/billing/statements/{tenant.tenant_id}/{this}", headers=h)
    assert r.status_code == 200 and r.json()["status"] == "draft", r.text
    console = Console(client=client, app=client.app, admin_key=admin_key)
    console.sign_in()
    assert client.get(f"/console/billing/statements/{tenant.tenant_id}/{future}").status_code == 404
    assert client.get(f"/console/billing/statements/{tenant.tenant_id}/{this}").status_code == 200


def test_an_override_is_never_carried_into_another_currency(app, client, admin_key):
    """An override's amounts were set in the currency its tenant was billed in: pricing the tenant's plan in
    another currency, or moving the tenant to a plan priced in one, is refused (409) while it is in force or
    scheduled, and goes through once it is cleared."""
    from loraplex.platform.billing.periods import next_period

    h = _admin(admin_key)
    tenant_id, tenant, _last = _setup(app, client, h)
    this = period_of(today_utc())
    plans = {p["name"]: p["id"] for p in client.get("/admin/api/plans", headers=h).json()}
    override = f"/admin/api/billing/tenants/{tenant_id}/price-override"
    basic_price = f"/admin/api/billing/prices/plans/{plans['basic']}"
    price = {"prompt_price": 1_000_000, "completion_price": 2_000_000, "adapter_surcharge_price": 0}

    for starts in (this, next_period(this)):  # in force now, and scheduled for next month
        assert client.put(override, headers=h, json={"prompt_price": 5, "effective_period": starts}).status_code == 200
        r = client.put(basic_price, headers=h, json={**price, "currency": "EUR", "effective_period": this})
        assert r.status_code == 409 and r.json()["error"]["param"] == "currency", r.text
        assert "hist" in r.json()["error"]["message"] and "USD" in r.json()["error"]["message"], r.text
        r = client.patch(f"/admin/api/tenants/{tenant_id}", headers=h, json={"plan": "pro"})
        assert r.status_code == 409 and r.json()["error"]["param"] == "plan", r.text
        assert client.get(f"/admin/api/tenants/{tenant_id}", headers=h).json()["plan"] == "basic"
        assert _statement(client, tenant, this)[0] == "USD"
        # the same currency is no conflict
        r = client.put(basic_price, headers=h, json={**price, "currency": "USD", "effective_period": this})
        assert r.status_code == 200, r.text
        assert client.put(override, headers=h, json={"effective_period": starts}).status_code == 200  # cleared

    r = client.put(basic_price, headers=h, json={**price, "currency": "EUR", "effective_period": this})
    assert r.status_code == 200, r.text
    assert _statement(client, tenant, this)[0] == "EUR"


def test_admin_billing_views_name_an_unknown_tenant_id(client, admin_key, make_tenant):
    """A mistyped tenant id is a 404 naming it, not an empty list that reads as "no usage"."""
    h = _admin(admin_key)
    tenant = make_tenant()
    this = period_of(today_utc())
    for path, params in (("/admin/api/billing/statements", {"period": this}),
                         ("/admin/api/billing/report", {}),
                         ("/admin/api/billing/statements", {})):
        r = client.get(path, headers=h, params={**params, "tenant_id": [tenant.tenant_id, 999]})
        assert r.status_code == 404 and "999" in r.json()["error"]["message"], (path, r.text)
        assert r.json()["error"]["param"] == "tenant_id"
        assert client.get(path, headers=h, params={**params, "tenant_id": tenant.tenant_id}).status_code == 200


def test_a_currency_change_already_scheduled_is_no_way_around_the_override_check(app, client, admin_key):
    """A plan that changes currency from a later month: an override set now, or a tenant with one moved onto
    that plan now, would bill its amounts in the other currency from then on: refused (409) too."""
    from loraplex.platform.billing.periods import next_period

    h = _admin(admin_key)
    tenant_id, _tenant, _last = _setup(app, client, h)  # "hist" on basic (USD); pro is in EUR
    this = period_of(today_utc())
    later = next_period(next_period(this))
    plans = {p["name"]: p["id"] for p in client.get("/admin/api/plans", headers=h).json()}
    override = f"/admin/api/billing/tenants/{tenant_id}/price-override"
    price = {"prompt_price": 1_000_000, "completion_price": 2_000_000, "adapter_surcharge_price": 0}

    # basic turns EUR from a later month, scheduled while no override exists: fine
    r = client.put(f"/admin/api/billing/prices/plans/{plans['basic']}", headers=h,
                   json={**price, "currency": "EUR", "effective_period": later})
    assert r.status_code == 200, r.text
    r = client.put(override, headers=h, json={"prompt_price": 5})
    assert r.status_code == 409 and r.json()["error"]["param"] == "currency", r.text
    message = r.json()["error"]["message"]
    assert "tenant hist, set in USD, in EUR from " + later in message, message
    # an override that ends before the switch is fine
    assert client.put(override, headers=h, json={"prompt_price": 5}).status_code == 409
    r = client.put(override, headers=h, json={"prompt_price": 5, "effective_period": later})
    assert r.status_code == 200, r.text  # set in EUR, billed in EUR
    assert client.put(override, headers=h, json={"effective_period": later}).status_code == 200

    # a tenant with a USD override moved now onto a plan that is USD now and EUR later
    r = client.put(f"/admin/api/billing/prices/plans/{plans['basic']}", headers=h,
                   json={**price, "currency": "USD", "effective_period": later})
    assert r.status_code == 200, r.text
    for period in (this, later):  # (the row from later on ended the override of this month there)
        r = client.put(override, headers=h, json={"prompt_price": 5, "effective_period": period})
        assert r.status_code == 200, r.text
    r = client.post("/admin/api/plans", headers=h, json={"name": "later-eur", **PLAN})
    later_eur = r.json()["id"]
    for period, currency in ((this, "USD"), (later, "EUR")):
        r = client.put(f"/admin/api/billing/prices/plans/{later_eur}", headers=h,
                       json={**price, "currency": currency, "effective_period": period})
        assert r.status_code == 200, r.text
    r = client.patch(f"/admin/api/tenants/{tenant_id}", headers=h, json={"plan": "later-eur"})
    assert r.status_code == 409 and r.json()["error"]["param"] == "plan", r.text
    assert client.get(f"/admin/api/tenants/{tenant_id}", headers=h).json()["plan"] == "basic"
