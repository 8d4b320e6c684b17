"""Console pages do what their buttons say: tenants, quotas, keys, prices, usage, billing, dashboard."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from console_helpers import Console
from sqlalchemy import select

from loraplex.platform.billing.models import TenantPrice
from loraplex.platform.models import ApiKey, Tenant, UsageRecord


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


def _tenant(console: Console, name: str) -> Tenant:
    with console.sessions() as s:
        return s.scalars(select(Tenant).where(Tenant.name == name)).one()


def test_create_tenant_edit_quotas_and_suspend(console):
    r = console.post("/console/plans", {"name": "pro", "requests_per_minute": "100", "tokens_per_minute": "1000",
                                        "max_concurrent": "4", "monthly_token_budget": "100000"})
    assert r.status_code == 303
    r = console.post("/console/tenants", {"name": "acme", "plan": "pro"})
    assert r.status_code == 303
    tenant = _tenant(console, "acme")
    assert tenant.plan.name == "pro"
    page = console.client.get(r.headers["location"])
    assert "Tenant acme created." in page.text

    r = console.post(f"/console/tenants/{tenant.id}", {"plan": "pro", "requests_per_minute": "7",
                                                       "tokens_per_minute": "", "max_concurrent": "",
                                                       "monthly_token_budget": ""})
    assert r.status_code == 303
    assert _tenant(console, "acme").requests_per_minute == 7
    bad = console.post(f"/console/tenants/{tenant.id}", {"requests_per_minute": "-3"})
    assert "must be at least 1" in console.client.get(bad.headers["location"]).text
    dup = console.post("/console/tenants", {"name": "acme"})
    assert "already exists" in console.client.get(dup.headers["location"]).text

    console.post(f"/console/tenants/{tenant.id}/status", {"status": "suspended"})
    assert _tenant(console, "acme").status == "suspended"
    console.post(f"/console/tenants/{tenant.id}/status", {"status": "active"})
    assert _tenant(console, "acme").status == "active"


def test_the_console_takes_every_quota_up_to_the_limit_the_api_takes(console):
    from loraplex.platform.schemas.tenants import QUOTA_MAX

    largest = {f: str(v) for f, v in QUOTA_MAX.items()}
    r = console.post("/console/plans", {"name": "huge", **largest})
    assert "Plan huge added." in console.client.get(r.headers["location"]).text
    console.post("/console/tenants", {"name": "big"})
    tenant = _tenant(console, "big")
    r = console.post(f"/console/tenants/{tenant.id}", {"plan": "", **largest})
    assert "Plan and quotas saved." in console.client.get(r.headers["location"]).text
    tenant = _tenant(console, "big")
    assert {f: getattr(tenant, f) for f in QUOTA_MAX} == QUOTA_MAX
    for field, limit in QUOTA_MAX.items():  # one past the limit: refused on the page, naming the limit
        r = console.post(f"/console/tenants/{tenant.id}", {field: str(limit + 1)})
        page = console.client.get(r.headers["location"]).text
        assert "Not saved" in page and str(limit) in page, field


def test_a_plans_quotas_are_edited_and_an_unused_plan_deleted_on_the_tenants_page(console):
    from loraplex.platform.models import Plan

    quotas = {"requests_per_minute": "1", "tokens_per_minute": "1", "max_concurrent": "1", "monthly_token_budget": "1"}
    console.post("/console/plans", {"name": "oops", **quotas})
    console.post("/console/plans", {"name": "spare", **quotas})
    console.post("/console/tenants", {"name": "acme", "plan": "oops"})
    with console.sessions() as s:
        ids = {p.name: p.id for p in s.scalars(select(Plan))}
    page = console.client.get("/console/tenants").text
    assert f'action="/console/plans/{ids["oops"]}"' in page
    assert f'/console/plans/{ids["spare"]}/delete' in page and f'/console/plans/{ids["oops"]}/delete' not in page

    r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "requests_per_minute": "600",
                                                         "monthly_token_budget": "9223372036854775807"})
    assert "Plan oops saved" in console.client.get(r.headers["location"]).text
    tenant = _tenant(console, "acme")
    assert tenant.plan.requests_per_minute == 600 and tenant.plan.monthly_token_budget == 2**63 - 1
    r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "max_concurrent": ""})
    assert "Plan not saved: max concurrent is required" in console.client.get(r.headers["location"]).text

    r = console.post(f"/console/plans/{ids['oops']}/delete")
    assert "Plan not deleted: plan &#39;oops&#39; has 1 tenant(s): acme" in console.client.get(r.headers["location"]).text
    r = console.post(f"/console/plans/{ids['spare']}/delete")
    assert "Plan spare deleted." in console.client.get(r.headers["location"]).text
    with console.sessions() as s:
        assert sorted(s.scalars(select(Plan.name))) == ["oops"]


def test_a_plan_is_renamed_on_the_tenants_page(console):
    """As PATCH /admin/api/plans/{id} with a name: its tenants stay on it; a name taken (whatever its case),
    empty or not a name is refused in words, and the row shows what was typed."""
    from loraplex.platform.models import Plan

    quotas = {"requests_per_minute": "5", "tokens_per_minute": "50", "max_concurrent": "1", "monthly_token_budget": "500"}
    console.post("/console/plans", {"name": "oops", **quotas})
    console.post("/console/plans", {"name": "gold", **quotas})
    console.post("/console/tenants", {"name": "acme", "plan": "oops"})
    with console.sessions() as s:
        ids = {p.name: p.id for p in s.scalars(select(Plan))}
    page = console.client.get("/console/tenants").text
    assert 'aria-label="Name of plan oops"' in page and f'form="plan-edit-{ids["oops"]}"' in page

    for name, words in [("GOLD", "a plan named &#39;gold&#39; already exists"), ("", "name is required"),
                        ("<b>x</b>", "name must be 1-64 letters")]:
        r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "name": name})
        page = console.client.get(r.headers["location"]).text
        assert f"Plan not saved: {words}" in page, page
    assert 'value="&lt;b&gt;x&lt;/b&gt;"' in page, "the refused name is shown as typed, escaped"

    r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "name": "basic"})
    assert "Plan basic (renamed from oops) saved" in console.client.get(r.headers["location"]).text
    assert _tenant(console, "acme").plan.name == "basic"
    r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "name": "Basic", "requests_per_minute": "6"})
    assert "Plan Basic (renamed from basic) saved" in console.client.get(r.headers["location"]).text
    r = console.post(f"/console/plans/{ids['oops']}", {**quotas, "requests_per_minute": "7"})
    assert "Plan Basic saved" in console.client.get(r.headers["location"]).text, "a form without a name keeps it"


def test_a_new_key_is_shown_once_and_works_until_revoked(console):
    console.post("/console/tenants", {"name": "acme"})
    tenant = _tenant(console, "acme")
    r = console.client.post(f"/console/tenants/{tenant.id}/keys", follow_redirects=False,
                            data={"csrf_token": console.csrf, "name": "ci", "scopes": ["inference", "usage"]})
    # post/redirect/get: reload and Back show the tenant's page, never a second POST making a second key
    assert r.status_code == 303 and r.headers["location"] == f"/console/tenants/{tenant.id}"
    assert "lpx_" not in r.headers["location"]
    shown = console.client.get(r.headers["location"])
    assert shown.headers["cache-control"] == "no-store"
    secret = re.search(r'id="new-key-value">(lpx_[^<]+)<', shown.text).group(1)
    assert secret not in console.client.get(f"/console/tenants/{tenant.id}").text  # shown once
    headers = {"Authorization": f"Bearer {secret}"}
    assert console.client.get("/v1/models", headers=headers).status_code == 200
    with console.sessions() as s:
        key = s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).one()
        assert key.scope_set == {"inference", "usage"}
    console.post(f"/console/keys/{key.id}/revoke")
    assert console.client.get("/v1/models", headers=headers).status_code == 401


def test_a_key_without_a_name_is_refused_as_the_cli_refuses_it(console):
    console.post("/console/tenants", {"name": "acme"})
    tenant = _tenant(console, "acme")
    for name in ("", "   "):
        r = console.post(f"/console/tenants/{tenant.id}/keys", {"name": name, "scopes": "inference"})
        assert r.status_code == 303
        assert "No key created: name must not be empty" in console.client.get(r.headers["location"]).text
    r = console.post("/console/tenants", {"name": "ACME"})  # names are unique whatever their case
    assert "already exists, and tenant names are unique whatever their case" in console.client.get(
        r.headers["location"]).text
    with console.sessions() as s:
        assert not s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).all()
        assert s.scalars(select(Tenant.name)).all() == ["acme"]


def test_tenant_price_override_round_trips_in_micro_units(console):
    console.post("/console/tenants", {"name": "acme"})
    tenant = _tenant(console, "acme")
    console.post(f"/console/tenants/{tenant.id}/prices", {"prompt": "0.123456", "completion": "", "adapter_surcharge": "2"})
    with console.sessions() as s:
        row = s.scalars(select(TenantPrice).where(TenantPrice.tenant_id == tenant.id)).one()
        assert (row.prompt_price, row.completion_price, row.adapter_surcharge_price) == (123_456, None, 2_000_000)
    bad = console.post(f"/console/tenants/{tenant.id}/prices", {"prompt": "0.1234567"})
    assert "more than 6 decimals" in console.client.get(bad.headers["location"]).text


@pytest.mark.parametrize(("plan_id", "words"), [
    ("99999999999999999999999", "is not an id that can exist"),
    ("abc", "plan id must be a whole number"),
    ("7", "no plan with id 7"),
])
def test_a_plan_price_for_a_plan_that_cannot_exist_is_refused_on_the_page(console, plan_id, words):
    r = console.post("/console/billing/prices", {"plan_id": plan_id, "prompt": "1", "completion": "2",
                                                 "adapter_surcharge": "0", "currency": "USD"})
    assert r.status_code == 303, r.text
    assert words in console.client.get(r.headers["location"]).text


def test_usage_and_billing_pages_show_inference_done_through_the_api(console, make_tenant):
    console.post("/console/billing/prices", {"plan_id": "", "prompt": "1", "completion": "2",
                                             "adapter_surcharge": "0", "currency": "USD"})
    tk = make_tenant("globex")
    r = console.client.post("/v1/chat/completions", headers=tk.headers, json={
        "model": "fake-base", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    services = console.app.state.services
    console.client.portal.call(services.usage.flush)  # on the app's loop, where the background flusher runs
    page = console.client.get("/console/usage")
    assert page.status_code == 200 and "globex" in page.text
    data = console.client.get(f"/console/usage/export?format=json&tenant_id={tk.tenant_id}").json()
    assert data["totals"]["prompt_tokens"] == usage["prompt_tokens"]
    assert data["totals"]["completion_tokens"] == usage["completion_tokens"]
    csv_text = console.client.get("/console/usage/export?format=csv").text
    assert csv_text.splitlines()[0].startswith("day,tenant_id,tenant,adapter,requests")
    per_key = console.client.get(f"/console/usage?tenant_id={tk.tenant_id}").text
    assert 'id="usage-keys"' in per_key and tk.key[:12] in per_key
    tenant_page = console.client.get(f"/console/tenants/{tk.tenant_id}").text
    assert f"/console/billing/statements/{tk.tenant_id}/" in tenant_page
    billing = console.client.get("/console/billing")
    assert billing.status_code == 200 and "globex" in billing.text
    dashboard = console.client.get("/console/api/dashboard").json()
    assert dashboard["window"]["requests"] >= 1


def test_playground_streams_as_the_tenant_and_is_billed_to_it(console, make_tenant):
    tk = make_tenant("initech")
    models = console.client.get(f"/console/api/models?tenant_id={tk.tenant_id}").json()["models"]
    assert models[0]["id"] == "fake-base"
    body = {"tenant_id": tk.tenant_id, "model": "fake-base", "max_tokens": 6,
            "messages": [{"role": "user", "content": "hi there"}]}
    r = console.client.post("/console/api/playground/chat", json=body, headers={"X-CSRF-Token": console.csrf})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")][-1]
    assert usage["completion_tokens"] == 6
    console.client.portal.call(console.app.state.services.usage.flush)
    with console.sessions() as s:
        record = s.scalars(select(UsageRecord).where(UsageRecord.tenant_id == tk.tenant_id)).one()
        assert (record.end_user, record.api_key_id, record.completion_tokens) == ("console", 0, 6)
    assert console.client.post("/console/api/playground/chat", json=body).status_code == 403
    console.post(f"/console/tenants/{tk.tenant_id}/status", {"status": "suspended"})
    suspended = console.client.post("/console/api/playground/chat", json=body, headers={"X-CSRF-Token": console.csrf})
    assert suspended.status_code == 403
    missing = console.client.post("/console/api/playground/chat", json={**body, "model": "nope"},
                                  headers={"X-CSRF-Token": console.csrf})
    assert missing.status_code in (403, 404)


def test_adapter_upload_needs_the_csrf_header_and_reports_the_failure_reason(console, make_tenant):
    tk = make_tenant("umbrella")
    url = f"/console/api/tenants/{tk.tenant_id}/adapters"
    files = {"file": ("adapter_model.bin", b"\x80\x04 not a pickle we will ever open", "application/octet-stream")}
    refused = console.client.post(url, data={"name": "bad", "csrf_token": console.csrf}, files=files)
    assert refused.status_code == 403  # a multipart post must carry the header, not a form field
    r = console.client.post(url, data={"name": "bad"}, files=files, headers={"X-CSRF-Token": console.csrf})
    assert r.status_code == 202, r.text
    status_url = r.json()["status_url"]
    console.app.state.services.tasks.join()
    status = console.client.get(status_url).json()
    assert status["status"] == "failed" and status["failure_reason"]
    page = console.client.get(f"/console/adapters?tenant_id={tk.tenant_id}")
    assert "bad" in page.text and status["failure_reason"].split(":")[0] in page.text
    other = make_tenant("other")
    assert console.client.get(status_url.replace(f"/tenants/{tk.tenant_id}/", f"/tenants/{other.tenant_id}/")
                              ).status_code == 404
    r = console.post(f"/console/tenants/{tk.tenant_id}/adapters/bad/delete")
    assert r.status_code == 303
    assert "bad" not in console.client.get(f"/console/adapters?tenant_id={tk.tenant_id}").text.split("<main>")[1] \
        .split("Upload an adapter")[1]


def test_billing_export_of_every_statement_for_a_period(console, make_tenant):
    make_tenant("acme")
    make_tenant("globex")
    period = console.client.get("/console/billing").text.split('<option selected>')[1][:7]
    data = console.client.get(f"/console/billing/export?period={period}&format=json").json()
    assert [s["tenant"] for s in data["data"]] == ["acme", "globex"]
    text = console.client.get(f"/console/billing/export?period={period}&format=csv").text
    assert text.splitlines()[0].startswith("tenant_id,tenant,period,status,currency")
    assert console.client.get("/console/billing/export?period=2026-99").status_code == 400


def test_json_exports_download_as_files_like_the_csv_ones(console, make_tenant):
    """The console's Export JSON links save a file, named as the CSV one is, instead of turning the tab into
    raw JSON; the API's JSON (read by programs) stays a plain response."""
    tk = make_tenant("acme")
    period = console.client.get("/console/billing").text.split('<option selected>')[1][:7]
    for url, name in [
        ("/console/usage/export?start=2026-12-01&end=2026-12-02&format={fmt}", "usage-2026-12-01-2026-12-02"),
        (f"/console/billing/export?period={period}&format={{fmt}}", f"statements-{period}"),
        (f"/console/billing/statements/{tk.tenant_id}/{period}?format={{fmt}}", f"statement-acme-{period}"),
    ]:
        for fmt in ("csv", "json"):
            r = console.client.get(url.format(fmt=fmt))
            assert r.status_code == 200, (url, r.text)
            assert r.headers.get("content-disposition") == f'attachment; filename="{name}.{fmt}"', (url, fmt)
        assert r.json()  # the JSON file is the same JSON as before
    api = console.client.get(f"/v1/billing/statements/{period}?format=json", headers=tk.headers)
    assert api.status_code == 200 and "content-disposition" not in api.headers


def test_exports_refuse_what_they_cannot_read(console, make_tenant):
    tk = make_tenant("acme")
    get = console.client.get
    for url, words in [
        ("/console/usage/export?format=xml", "format must be csv or json"),
        ("/console/usage/export?group_by=day,nonsense", "group_by takes some of"),
        ("/console/usage/export?tenant_id=abc", "tenant_id must be"),
        ("/console/usage/export?tenant_id=0", "tenant_id must be"),
        ("/console/usage/export?tenant_id=99999999999999999999999", "tenant_id must be"),
        ("/console/usage/export?start=2026-13-01", "start must be a day of the calendar written YYYY-MM-DD, got "
                                                   "'2026-13-01'"),
        ("/console/usage/export?start=20260101", "start must be a date written YYYY-MM-DD"),
        ("/console/usage/export?end=2026-01-01T00:00:00%2B02:00", "no time or time zone offset"),
        ("/console/usage/export?start=2026-02-01&end=2026-01-01", "start 2026-02-01 is after end 2026-01-01"),
        ("/console/usage/export?group_by=day,day,nonsense", "group_by takes some of"),
        ("/console/billing/export?format=pdf", "format must be csv or json"),
        ("/console/billing/export?period=2026-01%0A", "period must look like 2026-01"),
        (f"/console/billing/statements/{tk.tenant_id}/2026-11?format=xml", "format must be csv or json"),
    ]:
        r = get(url)
        assert r.status_code == 400 and words in r.text, (url, r.text)
    # a tenant filter that cannot be read is shown as an error, never widened to every tenant
    page = get("/console/usage?tenant_id=1x").text
    assert "tenant_id must be a tenant&#39;s numeric id" in page or "tenant_id must be a tenant's numeric id" in page
    assert get(f"/console/usage/export?group_by=tenant&tenant_id={tk.tenant_id}").status_code == 200
    # ids past what the database holds are refused by name, in paths too
    for url in ("/console/tenants/99999999999999999999999", "/console/billing/statements/5083142211507275694080/2026-11"):
        r = get(url)
        assert r.status_code == 400 and "tenant_id" in r.text, (url, r.text)


def test_nul_in_a_form_and_odd_digits_in_a_query_are_read_as_mistakes(console):
    console.post("/console/tenants", {"name": "acme"})
    tenant = _tenant(console, "acme")
    r = console.post(f"/console/tenants/{tenant.id}/keys", {"name": "k\x00"})
    assert r.status_code == 303 and "must not contain NUL" in console.client.get(r.headers["location"]).text
    r = console.post(f"/console/tenants/{tenant.id}", {"plan": "gold\x00"})
    assert r.status_code == 303 and "must not contain NUL" in console.client.get(r.headers["location"]).text
    r = console.post("/console/billing/finalize", {"period": "2026-1\x00"})
    assert r.status_code == 303 and "must not contain NUL" in console.client.get(r.headers["location"]).text
    # "²" is a digit to str.isdigit() but not to int(): the page shows no tenant selected
    assert console.client.get("/console/playground?tenant_id=%C2%B2").status_code == 200


def test_console_errors_are_pages_and_its_json_helpers_stay_json(console):
    """A console URL with an id that is not a number, or one that does not exist, answers with a console page
    (it was the API's JSON); the console's own JSON endpoints keep answering in JSON."""
    get = console.client.get
    for url, status, words in [("/console/tenants/abc", 400, "tenant_id"),
                               ("/console/adapters/1", 404, "Not Found"),
                               ("/console/no-such-page", 404, "Not Found")]:
        r = get(url)
        assert r.status_code == status, (url, r.text)
        assert r.headers["content-type"].startswith("text/html"), (url, r.headers)
        assert "<html" in r.text and words in r.text and "Back to the dashboard" in r.text, (url, r.text)
        assert "x-request-id" in r.headers
    r = get("/console/api/models?tenant_id=abc")
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "tenant_id"
    # the API itself is unchanged
    r = get("/v1/no-such-route")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")


def test_the_dashboard_lists_every_tenant_whose_adapter_a_cached_copy_serves(console, make_tenant):
    """Two tenants who uploaded the same weights share one cached copy: the dashboard names both, and
    versions no longer ready are not listed."""
    from loraplex.platform.console.dashboard import _adapter_names
    from loraplex.platform.models import Adapter, AdapterVersion

    shared, other = "ab" * 32, "cd" * 32
    ids = {name: make_tenant(name).tenant_id for name in ("acme", "beta", "gamma")}
    with console.sessions() as s:
        for tenant_name, adapter_name, content, status in (("acme", "bot", shared, "ready"),
                                                           ("beta", "helper", shared, "ready"),
                                                           ("gamma", "gone", shared, "deleted"),
                                                           ("acme", "solo", other, "ready")):
            adapter = Adapter(tenant_id=ids[tenant_name], name=adapter_name)
            s.add(adapter)
            s.flush()
            s.add(AdapterVersion(adapter_id=adapter.id, tenant_id=ids[tenant_name], status=status,
                                 upload_sha256="0" * 64, upload_filename="a.zip", upload_bytes=1,
                                 content_hash=content))
        s.commit()
    names = _adapter_names(console.app.state.services, {shared, other})
    assert sorted((e["name"], e["tenant"]) for e in names[shared]) == [("bot", "acme"), ("helper", "beta")]
    assert [(e["name"], e["tenant"]) for e in names[other]] == [("solo", "acme")]


def test_a_pin_shows_on_the_version_pinned_only(console, make_tenant, peft_adapter_zip, fake_engine):
    """Two tenants with the same weights: pinning one's version in the console marks that version, not the
    other tenant's (which shares the cached copy, not the pin)."""
    from platform_helpers import upload

    a, b = make_tenant("acme"), make_tenant("beta")
    va = upload(console.client, a, "one", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    vb = upload(console.client, b, "two", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    r = console.post(f"/console/tenants/{a.tenant_id}/versions/{va['id']}/prefetch", {"pin": "1"})
    assert r.status_code == 303
    # straight to the engine (through the router, every engine process), not a task one engine would take
    assert fake_engine.prefetched[-1] == (va["content_hash"], True)
    page_a = console.client.get(f"/console/adapters?tenant_id={a.tenant_id}").text
    page_b = console.client.get(f"/console/adapters?tenant_id={b.tenant_id}").text
    assert 'class="badge pinned"' in page_a and ">Unpin<" in page_a
    assert 'class="badge pinned"' not in page_b and ">Pin<" in page_b and vb["id"]


def test_filters_naming_nothing_say_so_and_the_selects_show_what_is_shown(console):
    page = console.client.get("/console/usage?tenant_id=999").text
    assert "There is no tenant 999" in page
    billing = console.client.get("/console/billing?period=2030-01").text
    assert "<option selected>2030-01</option>" in billing, "the select shows another period"


def test_the_usage_page_says_amounts_are_at_each_months_prices_and_computes_them_so(console, make_tenant):
    """A range over a price change: last month's tokens at last month's price, this month's at this month's
    (3.00 here, where "current prices" would make it 4.00), and the page says so."""
    import uuid
    from datetime import UTC, datetime, timedelta

    from loraplex.platform.billing.periods import period_of

    tk = make_tenant("acme")
    now = datetime.now(UTC)
    last_month = now.replace(day=1) - timedelta(days=1)
    with console.sessions() as s:
        for at in (last_month, now):
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tk.tenant_id, api_key_id=tk.key_id, model="base",
                              endpoint="chat", prompt_tokens=1_000_000, completion_tokens=0, ttft_ms=1, latency_ms=1,
                              status="ok", created_at=at))
        s.commit()
    for period, price in ((period_of(last_month.date()), "1"), (period_of(now.date()), "2")):
        r = console.post("/console/billing/prices", {"prompt": price, "completion": "0", "adapter_surcharge": "0",
                                                     "currency": "USD", "period": period})
        assert "Prices saved" in console.client.get(r.headers["location"]).text
    page = console.client.get(f"/console/usage?start={last_month.date().replace(day=1)}&end={now.date()}").text
    assert "at each month&#39;s prices" in page or "at each month's prices" in page
    assert "current prices" not in page
    total = re.search(r'<div class="label">Estimated amount</div><div class="value">([^<]*)<', page).group(1)
    assert total.strip() == "3.000000 USD", total


def test_one_version_is_deleted_from_the_adapters_page(console, make_tenant, peft_adapter_zip, peft_adapter_dir,
                                                      tmp_path, app):
    """As the admin API's DELETE .../versions/{id}: a failed upload goes alone, the adapter stays with its
    ready version; the last version takes the adapter with it; a version of another tenant is not reached."""
    from platform_helpers import upload
    from safetensors.torch import load_file, save_file

    tenant, other = make_tenant("acme"), make_tenant("beta")
    good = upload(console.client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    tensors = load_file(str(peft_adapter_dir / "adapter_model.safetensors"))
    tensors[next(k for k in tensors if "lora_A" in k)][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    upload(console.client, tenant, "bot", [
        ("adapter_config.json", (peft_adapter_dir / "adapter_config.json").read_bytes()),
        ("adapter_model.safetensors", (tmp_path / "adapter_model.safetensors").read_bytes())], wait=False)
    app.state.services.tasks.join()
    failed = console.client.get("/v1/adapters/bot", headers=tenant.headers).json()["versions"][1]
    assert failed["status"] == "failed"

    page = console.client.get(f"/console/adapters?tenant_id={tenant.tenant_id}").text
    action = f"/console/tenants/{tenant.tenant_id}/adapters/bot/versions/{failed['id']}/delete"
    assert f'action="{action}"' in page, "no Delete button for a failed version"

    r = console.post(f"/console/tenants/{other.tenant_id}/adapters/bot/versions/{failed['id']}/delete")
    assert "No adapter named &#39;bot&#39;" in console.client.get(r.headers["location"]).text

    r = console.post(action)
    assert r.status_code == 303
    page = console.client.get(r.headers["location"]).text
    assert f"bot version {failed['id']} deleted." in page, page
    versions = console.client.get("/v1/adapters/bot", headers=tenant.headers).json()["versions"]
    assert [v["id"] for v in versions] == [good["id"]]

    r = console.post(action)
    assert f"has no version with id {failed['id']}" in console.client.get(r.headers["location"]).text

    r = console.post(f"/console/tenants/{tenant.tenant_id}/adapters/bot/versions/{good['id']}/delete")
    page = console.client.get(r.headers["location"]).text
    assert f"bot@{good['version']} deleted. It was the last version of bot: the adapter is deleted too." in page
    assert console.client.get("/v1/adapters/bot", headers=tenant.headers).status_code == 404


class _FormControls(HTMLParser):
    """Visible form controls of a page, and whether each has a name a screen reader can say: a <label>
    around it, a <label for> its id, or an aria-label."""

    def __init__(self):
        super().__init__()
        self.open_labels = 0
        self.label_for: set[str] = set()
        self.controls: list[tuple[dict, bool]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "label":
            self.open_labels += 1
            if a.get("for"):
                self.label_for.add(a["for"])
        elif tag in ("input", "select", "textarea") and a.get("type") not in ("hidden", "submit"):
            self.controls.append((a, self.open_labels > 0 or bool(a.get("aria-label"))))

    def handle_endtag(self, tag):
        if tag == "label":
            self.open_labels -= 1

    def unlabelled(self) -> list[str]:
        return [a.get("name") or a.get("id") or "?" for a, labelled in self.controls
                if not labelled and a.get("id") not in self.label_for]


def test_every_form_control_has_a_label(console, make_tenant, client, admin_key):
    """Quota and price overrides, the plans' price lists and the playground's message box included."""
    console.post("/console/plans", {"name": "pro", "requests_per_minute": "100", "tokens_per_minute": "1000",
                                    "max_concurrent": "4", "monthly_token_budget": "100000"})
    tenant = make_tenant("acme")
    pages = ["/console/tenants", f"/console/tenants/{tenant.tenant_id}", "/console/billing", "/console/usage",
             f"/console/adapters?tenant_id={tenant.tenant_id}", "/console/playground", "/console/dashboard"]
    for path in pages:
        parser = _FormControls()
        parser.feed(console.client.get(path).text)
        assert parser.controls or path == "/console/dashboard", path
        assert parser.unlabelled() == [], f"{path}: form controls without a label"
    billing = console.client.get("/console/billing").text
    assert 'aria-label="Prompt price of pro"' in billing


def test_a_date_the_usage_page_cannot_read_keeps_the_tenant_filter(console, make_tenant):
    """A start after the end (easy to pick in two date fields) is said so, and the page still shows the
    tenant asked for, not every tenant's usage."""
    acme, other = make_tenant("acme"), make_tenant("other")
    page = console.client.get(f"/console/usage?start=2026-12-05&end=2026-12-01&tenant_id={acme.tenant_id}").text
    assert "Bad date range: start 2026-12-05 is after end 2026-12-01; showing " in page, page
    assert f'<option value="{acme.tenant_id}" selected>acme</option>' in page
    assert 'id="usage-keys"' in page, "the tenant's by-key table is shown"
    # the export buttons submit the filter form, whose tenant is the one selected above
    assert 'formaction="/console/usage/export" name="format" value="csv"' in page
    page = console.client.get("/console/usage?start=2026-12-01&end=2026-12-02&tenant_id=abc").text
    assert "tenant_id must be a tenant&#39;s numeric id, got &#39;abc&#39;; showing all tenants." in page
    assert 'value="2026-12-01"' in page and 'value="2026-12-02"' in page, "the dates typed are kept"
    assert other.tenant_id


def test_exports_are_not_kept_in_a_browser_cache(console, make_tenant):
    """Usage, statements and a statement hold tenants' money: no-store, as every console page."""
    tenant = make_tenant("acme")
    period = console.client.get("/console/billing").text.split("<option selected>")[1].split("<")[0]
    for path in ("/console/usage/export?format=csv", "/console/usage/export?format=json",
                 f"/console/billing/export?period={period}&format=csv", f"/console/billing/export?period={period}&format=json",
                 f"/console/billing/statements/{tenant.tenant_id}/{period}?format=csv",
                 f"/console/billing/statements/{tenant.tenant_id}/{period}?format=json"):
        r = console.client.get(path)
        assert r.status_code == 200 and "attachment" in r.headers["content-disposition"], (path, r.text)
        assert r.headers["cache-control"] == "no-store", path


def test_a_prefetch_of_a_version_that_is_not_there_or_not_ready_says_which(console, make_tenant, peft_adapter_zip):
    from platform_helpers import upload

    from loraplex.platform.models import AdapterVersion

    tenant, other = make_tenant("acme"), make_tenant("beta")
    version = upload(console.client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    r = console.post(f"/console/tenants/{other.tenant_id}/versions/{version['id']}/prefetch")
    page = console.client.get(r.headers["location"]).text
    assert f"Nothing prefetched: tenant {other.tenant_id} has no adapter version with id {version['id']}." in page
    with console.sessions() as session:
        session.get(AdapterVersion, version["id"]).status = "failed"
        session.commit()
    r = console.post(f"/console/tenants/{tenant.tenant_id}/versions/{version['id']}/prefetch")
    page = console.client.get(r.headers["location"]).text
    assert f"Nothing prefetched: bot version {version['id']} is failed; only a ready version" in page, page
