"""What an operator runs into at the edges: concurrent admin changes, billed months' prices, digit-only tenant
names, odd query values on console pages, error pages that keep a working sign-out, pins that can be undone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from console_helpers import CSRF_META, Console
from sqlalchemy import select

from loraplex.platform.billing.models import Statement
from loraplex.platform.models import Tenant


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _admin(admin_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_key}"}


def test_concurrent_identical_admin_changes_are_conflicts_not_errors(client, admin_key):
    """The same new plan, the same period's price: one request wins, the others get 409 (or succeed), and
    none a 500 from the database's unique constraint."""
    headers = _admin(admin_key)
    plan = {"name": "gold", "requests_per_minute": 10, "tokens_per_minute": 1000, "max_concurrent": 2,
            "monthly_token_budget": 10_000}
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: client.post("/admin/api/plans", headers=headers, json=plan).status_code,
                              range(12)))
    assert codes.count(201) == 1 and set(codes) <= {201, 409}, codes
    price = {"prompt_price": 1, "completion_price": 2, "adapter_surcharge_price": 0, "effective_period": "2030-01"}
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: client.put("/admin/api/billing/prices/default", headers=headers,
                                                   json=price).status_code, range(12)))
    assert set(codes) <= {200, 409} and 200 in codes, codes


def test_a_billed_month_keeps_its_prices(client, admin_key, make_tenant, app):
    tenant = make_tenant("acme")
    with app.state.services.sessions() as session:
        session.add(Statement(tenant_id=tenant.tenant_id, period="2026-10", currency="USD", requests=0,
                              prompt_tokens=0, completion_tokens=0, total_amount=0))
        session.commit()
    headers = _admin(admin_key)
    body = {"prompt_price": 1, "completion_price": 2, "adapter_surcharge_price": 0, "effective_period": "2026-10"}
    r = client.put("/admin/api/billing/prices/default", headers=headers, json=body)
    assert r.status_code == 409 and r.json()["error"]["param"] == "effective_period", r.text
    assert "2026-10 are final" in r.json()["error"]["message"] and "from 2026-11 on" in r.json()["error"]["message"]
    r = client.put(f"/admin/api/billing/tenants/{tenant.tenant_id}/price-override", headers=headers,
                   json={"prompt_price": 5, "effective_period": "2026-09"})
    assert r.status_code == 409, r.text
    r = client.put("/admin/api/billing/prices/default", headers=headers, json={**body, "effective_period": "2026-11"})
    assert r.status_code == 200, r.text


def test_tenant_names_of_digits_only_are_refused(client, admin_key, console):
    """The CLI takes a tenant's name or id: a tenant named "1" would be read as tenant 1."""
    r = client.post("/admin/api/tenants", headers=_admin(admin_key), json={"name": "42"})
    assert r.status_code == 400 and "digits only" in r.json()["error"]["message"], r.text
    assert client.post("/admin/api/tenants", headers=_admin(admin_key), json={"name": "team42"}).status_code == 201
    r = console.post("/console/tenants", {"name": "7"})
    assert "digits only" in console.client.get(r.headers["location"]).text


def test_currencies_are_iso_codes_in_the_console_too(console):
    r = console.post("/console/billing/prices", {"plan_id": "", "prompt": "1", "completion": "2",
                                                 "adapter_surcharge": "0", "currency": "éur"})
    assert "3-letter ISO code" in console.client.get(r.headers["location"]).text
    r = console.post("/console/billing/prices", {"plan_id": "", "prompt": "1", "completion": "2",
                                                 "adapter_surcharge": "0", "currency": "xyz"})
    assert "ISO 4217" in console.client.get(r.headers["location"]).text
    r = console.post("/console/billing/prices", {"plan_id": "", "prompt": "1", "completion": "2",
                                                 "adapter_surcharge": "0", "currency": "eur"})
    assert "Prices saved" in console.client.get(r.headers["location"]).text


def test_currencies_that_iso_4217_does_not_know_are_refused_by_the_admin_api(client, admin_key):
    body = {"prompt_price": 1, "completion_price": 2, "adapter_surcharge_price": 0}
    for code in ("XYZ", "ABC"):
        r = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key), json={**body, "currency": code})
        assert r.status_code == 400 and "ISO 4217" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "currency", r.text
    for code in ("JPY", "CHF", "EUR"):
        r = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key), json={**body, "currency": code})
        assert r.status_code == 200 and r.json()["price"]["currency"] == code, r.text


def test_odd_query_values_get_a_message_not_a_server_error(console):
    client = console.client
    assert client.get("/console/playground?tenant_id=" + "9" * 5000).status_code == 200
    r = client.get("/console/usage?tenant_id=" + "9" * 5000)
    assert r.status_code < 500 and "set_int_max_str_digits" not in r.text
    r = client.get("/console/adapters?tenant_id=999")
    assert r.status_code == 404 and "No tenant &#39;999&#39;" in r.text  # not another tenant's adapters
    # with no tenant at all the period is still checked, and never reaches a header
    r = client.get("/console/billing?period=junk", follow_redirects=False)
    assert r.status_code == 303 and "Not a period" in client.get(r.headers["location"]).text
    assert client.get("/console/billing?period=9999-01", follow_redirects=False).status_code == 303
    r = client.get("/console/billing/export?format=csv&period=a%0d%0aX:1")
    assert r.status_code == 400 and "x" not in r.headers
    assert client.get('/console/billing/export?period=a"b').status_code == 400
    r = console.post("/console/plans", {"name": "uni", "requests_per_minute": "١٢", "tokens_per_minute": "1000",
                                        "max_concurrent": "4", "monthly_token_budget": "100000"})
    assert "must be a whole number" in client.get(r.headers["location"]).text
    r = console.post("/console/plans", {"name": "uni", "requests_per_minute": "9" * 5000, "tokens_per_minute": "1",
                                        "max_concurrent": "4", "monthly_token_budget": "100000"})
    page = client.get(r.headers["location"]).text
    assert "too large" in page and "9" * 100 not in page


def test_an_error_page_keeps_a_working_sign_out(console):
    page = console.client.get("/console/tenants/abc")
    assert page.status_code >= 400
    token = CSRF_META.search(page.text).group(1)
    assert token == console.csrf
    r = console.client.post("/console/logout", data={"csrf_token": token}, follow_redirects=False)
    assert r.status_code == 303
    assert console.client.get("/console/dashboard", follow_redirects=False).status_code == 303  # signed out


def test_a_finalized_month_lists_only_the_tenants_it_billed(console, make_tenant, app, client, admin_key):
    from loraplex.platform.billing.statements import finalize_period

    make_tenant("old")
    with app.state.services.sessions() as session:
        session.get(Tenant, session.scalar(select(Tenant.id).where(Tenant.name == "old"))).created_at = \
            datetime(2026, 9, 5, tzinfo=UTC)
        session.commit()
        assert finalize_period(session, "2026-10", now=datetime(2026, 11, 2, tzinfo=UTC)) == 1
        session.commit()
    make_tenant("newer")  # created now, after October
    page = console.client.get("/console/billing?period=2026-10").text
    assert "old" in page and "newer" not in page
    export = console.client.get("/console/billing/export?period=2026-10&format=json").json()["data"]
    assert [s["tenant"] for s in export] == ["old"]
    listed = client.get("/admin/api/billing/statements?period=2026-10", headers=_admin(admin_key)).json()["data"]
    assert [s["tenant"] for s in listed] == ["old"]


def test_a_pin_can_be_undone(client, admin_key, make_tenant, peft_adapter_zip, fake_engine):
    from platform_helpers import upload

    tenant = make_tenant()
    version = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
    path = f"/admin/api/adapter-versions/{version['id']}/prefetch"
    for pin in (True, False, None):
        r = client.post(path, headers=_admin(admin_key), json={} if pin is None else {"pin": pin})
        assert r.status_code == 200 and r.json()["pinned"] is pin, r.text
        if pin is not None:  # the admin listing shows each version's pin
            (listed,) = client.get("/admin/api/adapters", headers=_admin(admin_key)).json()
            assert listed["versions"][0]["pinned"] is pin
    assert [p for _h, p in fake_engine.prefetched[-3:]] == [True, False, None]


def test_a_pin_flag_is_true_false_1_or_0_in_the_admin_api_and_the_console(client, app, admin_key, make_tenant,
                                                                          peft_adapter_zip, fake_engine):
    """The same four spellings everywhere a pin is taken; anything else is refused by name, never read as
    "leave the pin as it is" (the console read "true" so, and prefetched without pinning)."""
    from console_helpers import Console
    from platform_helpers import upload

    tenant = make_tenant()
    version = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
    path = f"/admin/api/adapter-versions/{version['id']}/prefetch"
    for value, pinned in ((1, True), (0, False), ("true", True), ("0", False), (True, True), (False, False)):
        r = client.post(path, headers=_admin(admin_key), json={"pin": value})
        assert r.status_code == 200 and r.json()["pinned"] is pinned, (value, r.text)
        assert fake_engine.prefetched[-1][1] is pinned
    for value in (2, -1, 1.5, "yes", "", "on", [True], {"x": 1}):
        r = client.post(path, headers=_admin(admin_key), json={"pin": value})
        assert r.status_code == 400, (value, r.text)
        error = r.json()["error"]
        assert error["param"] == "pin" and "must be true, false, 1 or 0" in error["message"], (value, error)
    console = Console(client=client, app=app, admin_key=admin_key)
    console.sign_in()
    page = f"/console/tenants/{tenant.tenant_id}/versions/{version['id']}/prefetch"
    for value, pinned in (("true", True), ("false", False), ("1", True), ("0", False)):
        r = console.post(page, {"pin": value})
        assert r.status_code == 303 and fake_engine.prefetched[-1][1] is pinned, value
    count = len(fake_engine.prefetched)
    for value in ("yes", "2", "pin"):
        r = console.post(page, {"pin": value})
        assert r.status_code == 303
        assert "must be true, false, 1 or 0" in client.get(r.headers["location"]).text, value
    assert len(fake_engine.prefetched) == count  # nothing was prefetched for a pin it could not read
    assert console.post(page).status_code == 303 and fake_engine.prefetched[-1][1] is None  # Prefetch alone


def test_a_unique_constraint_lost_to_a_concurrent_change_is_a_409(client, admin_key, monkeypatch):
    """Whatever route loses such a race (the database keeps the other request's row) answers 409, not 500."""
    from sqlalchemy.exc import IntegrityError

    import loraplex.platform.billing.admin_routes as routes

    def lost_race(*args, **kwargs):
        raise IntegrityError("INSERT INTO plan_prices ...", {}, Exception("UNIQUE constraint failed"))

    monkeypatch.setattr(routes, "set_plan_price", lost_race)
    r = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key),
                   json={"prompt_price": 1, "completion_price": 2, "adapter_surcharge_price": 0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
    assert "retry" in r.json()["error"]["message"]


def test_console_totals_are_per_currency(console, client, admin_key, make_tenant, app):
    import uuid

    from loraplex.platform.billing.periods import period_of, today_utc
    from loraplex.platform.models import UsageRecord

    headers = _admin(admin_key)
    plan = client.post("/admin/api/plans", headers=headers, json={
        "name": "euro", "requests_per_minute": 10, "tokens_per_minute": 1000, "max_concurrent": 2,
        "monthly_token_budget": 10_000}).json()
    assert client.put("/admin/api/billing/prices/default", headers=headers, json={
        "prompt_price": 1_000_000, "completion_price": 0, "adapter_surcharge_price": 0}).status_code == 200
    assert client.put(f"/admin/api/billing/prices/plans/{plan['id']}", headers=headers, json={
        "prompt_price": 2_000_000, "completion_price": 0, "adapter_surcharge_price": 0,
        "currency": "EUR"}).status_code == 200
    dollars, euros = make_tenant("dollars"), make_tenant("euros", plan="euro")
    with app.state.services.sessions() as session:
        for tenant in (dollars, euros):
            session.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                                    model="base", endpoint="chat", prompt_tokens=1_000_000, completion_tokens=0,
                                    ttft_ms=1, latency_ms=2, status="ok", created_at=datetime.now(UTC)))
        session.commit()
    billing = console.client.get(f"/console/billing?period={period_of(today_utc())}").text
    assert "1.000000 USD" in billing and "2.000000 EUR" in billing and "3.000000" not in billing
    usage = console.client.get("/console/usage").text
    assert "1.000000 USD" in usage and "2.000000 EUR" in usage and "3.000000" not in usage


def test_a_prefetch_with_no_engine_reachable_is_a_503(client, admin_key, make_tenant, peft_adapter_zip, fake_engine,
                                                      monkeypatch):
    from platform_helpers import upload

    from loraplex.engine.errors import EngineUnreachableError

    tenant = make_tenant()
    version = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()

    async def gone(*args, **kwargs):
        raise EngineUnreachableError("engine http://10.0.0.9:8001 is unreachable: connection refused")

    monkeypatch.setattr(fake_engine, "prefetch_adapter", gone)
    r = client.post(f"/admin/api/adapter-versions/{version['id']}/prefetch", headers=_admin(admin_key), json={})
    assert r.status_code == 503 and r.headers["retry-after"], r.text  # (a pin is recorded: 202, below)
    assert "10.0.0.9" not in r.text


def test_a_pin_no_engine_can_take_now_is_recorded_and_synced_later(client, admin_key, make_tenant, peft_adapter_zip,
                                                                   fake_engine, app):
    """The pin is in the database (the engines' source): 202 "sync", not a 503 for a change that was made;
    a plain prefetch with no engine to take it stays a 503."""
    from platform_helpers import upload

    from loraplex.engine.errors import EngineUnreachableError
    from loraplex.platform.models import AdapterVersion

    version = upload(client, make_tenant(), "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()

    async def away(adapter, *, pin=None):
        raise EngineUnreachableError("engine http://e1 is unreachable: ConnectTimeout")

    fake_engine.prefetch_adapter = away
    path = f"/admin/api/adapter-versions/{version['id']}/prefetch"
    r = client.post(path, headers=_admin(admin_key), json={"pin": True})
    assert r.status_code == 202 and r.json()["where"] == "sync" and r.json()["pinned"] is True, r.text
    with app.state.services.sessions() as session:
        assert session.get(AdapterVersion, version["id"]).pinned is True
    r = client.post(path, headers=_admin(admin_key), json={})
    assert r.status_code == 503, r.text


def test_a_pin_the_engine_cannot_load_is_a_422_and_not_recorded(client, admin_key, make_tenant, peft_adapter_zip,
                                                                 fake_engine, app):
    from platform_helpers import upload

    from loraplex.engine.errors import AdapterLoadError
    from loraplex.platform.models import AdapterVersion

    version = upload(client, make_tenant(), "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()

    async def corrupt(adapter, *, pin=None):
        raise AdapterLoadError("adapter 'bot' refused: corrupt safetensors file")

    fake_engine.prefetch_adapter = corrupt
    r = client.post(f"/admin/api/adapter-versions/{version['id']}/prefetch", headers=_admin(admin_key),
                    json={"pin": True})
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_failed", r.text
    assert "corrupt safetensors" in r.json()["error"]["message"]
    with app.state.services.sessions() as session:
        assert session.get(AdapterVersion, version["id"]).pinned is False


def test_a_console_pin_the_engine_cannot_load_is_not_recorded(console, make_tenant, peft_adapter_zip, fake_engine):
    """As the admin API's 422: the page says the engine could not load it, and the version is not left
    marked pinned (a pin the engines' pin sync would keep failing to apply)."""
    from platform_helpers import upload

    from loraplex.engine.errors import AdapterLoadError
    from loraplex.platform.models import AdapterVersion

    tenant = make_tenant("acme")
    version = upload(console.client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()

    async def corrupt(adapter, *, pin=None):
        raise AdapterLoadError("adapter 'bot' refused: corrupt safetensors file")

    fake_engine.prefetch_adapter = corrupt
    r = console.post(f"/console/tenants/{tenant.tenant_id}/versions/{version['id']}/prefetch", {"pin": "1"})
    page = console.client.get(r.headers["location"]).text
    assert "could not be loaded by the engine and is not pinned: adapter &#39;bot&#39; refused: corrupt" in page, page
    assert 'class="badge pinned"' not in page and ">Pin<" in page
    with console.sessions() as session:
        assert session.get(AdapterVersion, version["id"]).pinned is False


@pytest.mark.parametrize(("form", "words"), [
    ({"name": "<b>p3</b>"}, "name must be 1-64 letters, digits, &#39;.&#39;, &#39;_&#39; or &#39;-&#39;, starting with"),
    ({"name": "héllo"}, "name must be 1-64 letters"),
    ({"name": "42"}, "name: a tenant name must not be digits only"),
])
def test_console_tenant_names_are_refused_in_words(console, form, words):
    """A refused name says the rule, not pydantic's regex or its "Value error," prefix."""
    page = console.client.get(console.post("/console/tenants", form).headers["location"]).text
    assert "Could not create the tenant: " + words in page, page
    assert "should match pattern" not in page and "Value error" not in page and "^[A-Za-z" not in page


def test_console_plan_and_key_errors_are_in_words(console, make_tenant):
    tk = make_tenant("acme")
    r = console.post("/console/plans", {"name": "<b>p3</b>", "requests_per_minute": "1", "tokens_per_minute": "1",
                                        "max_concurrent": "1", "monthly_token_budget": "1"})
    page = console.client.get(r.headers["location"]).text
    assert "Could not add the plan: name must be 1-64 letters" in page and "should match pattern" not in page
    r = console.post(f"/console/tenants/{tk.tenant_id}/keys", {"name": "k" * 65})
    page = console.client.get(r.headers["location"]).text
    assert "No key created: name must be at most 64 characters long (this one has 65)" in page, page


def test_console_dates_that_cannot_be_read_are_said_so(console):
    page = console.client.get("/console/usage?start=garbage").text
    assert "start must be a date written YYYY-MM-DD, like 2026-12-01; got &#39;garbage&#39;" in page
    assert "isoformat" not in page
    r = console.client.get("/console/usage/export?end=2026-02-30")
    assert r.status_code == 400
    assert r.text == "end must be a day of the calendar written YYYY-MM-DD, got '2026-02-30'\n"


def test_admin_api_says_a_pattern_as_its_rule(client, admin_key):
    r = client.post("/admin/api/tenants", headers=_admin(admin_key), json={"name": "<b>p3</b>"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "name" and error["type"] == "invalid_request_error"
    assert error["message"] == ("Invalid value for 'name': must be 1-64 letters, digits, '.', '_' or '-', "
                                "starting with a letter or digit"), error
    r = client.post("/admin/api/tenants", headers=_admin(admin_key), json={"name": "42"})
    assert "Value error" not in r.json()["error"]["message"] and "digits only" in r.json()["error"]["message"]
    body = {"prompt_price": 1, "completion_price": 2, "adapter_surcharge_price": 0, "currency": "usd"}
    r = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key), json=body)
    assert r.json()["error"]["param"] == "currency" and "^[" not in r.json()["error"]["message"], r.text


def test_a_nul_in_a_console_url_is_a_console_page(console, client):
    """Refused before routing as everywhere, but a browser on a console page gets the console's error page (with
    its menu once signed in), not the API's JSON; the console's JSON helpers keep answering in JSON."""
    r = client.get("/console/usage?start=2026-12-01%00")
    assert r.status_code == 400 and r.headers["content-type"].startswith("text/html"), r.text
    assert "NUL (%00)" in r.text and 'id="logout"' in r.text and "<title>Not a valid request · loraplex</title>" in r.text
    r = client.get("/console/api/dashboard?x=%00")
    assert r.status_code == 400 and "NUL" in r.json()["error"]["message"]
    client.cookies.clear()
    r = client.get("/console/login?next=%00")
    assert r.status_code == 400 and r.headers["content-type"].startswith("text/html") and 'id="logout"' not in r.text
