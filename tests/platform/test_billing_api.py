"""Billing over HTTP: tenants see only their own usage and statements; admins report across tenants."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from loraplex.platform.billing.periods import period_of, today_utc
from loraplex.platform.db import session_scope
from loraplex.platform.models import UsageRecord


@pytest.fixture
def usage(app, make_tenant):
    """Two tenants with known usage this month and last month."""
    a, b = make_tenant("acme"), make_tenant("globex")
    now = datetime.now(UTC).replace(microsecond=0)
    last_month = now.replace(day=1) - timedelta(days=3)
    rows = [
        (a, now, 100, 10, "sql", "a" * 64), (a, now, 200, 20, None, None), (a, last_month, 1000, 100, None, None),
        (b, now, 5000, 500, "secret", "b" * 64),
    ]
    with session_scope(app.state.services.sessions) as s:
        for tenant, at, p, c, name, version in rows:
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                              model=name or "base", adapter_name=name, adapter_version=version, endpoint="chat",
                              prompt_tokens=p, completion_tokens=c, ttft_ms=1, latency_ms=10, status="ok",
                              created_at=at))
    return a, b, last_month


def _admin(admin_key):
    return {"Authorization": f"Bearer {admin_key}"}


def test_tenant_statements_list_and_detail_are_its_own(client, usage, admin_key):
    a, b, _ = usage
    client.put("/admin/api/billing/prices/default", headers=_admin(admin_key),
               json={"prompt_price": 1_000_000, "completion_price": 3_000_000, "adapter_surcharge_price": 500_000})
    period = period_of(today_utc())
    r = client.get(f"/v1/billing/statements/{period}", headers=a.headers)
    assert r.status_code == 200
    body = r.json()
    assert body["tenant"] == "acme" and body["status"] == "draft"
    assert (body["prompt_tokens"], body["completion_tokens"]) == (300, 30)
    assert all(line["adapter"] != "secret" for line in body["lines"])
    # 300 prompt x 1.0 + 30 x 3.0 + 110 adapter tokens x 0.5, per million, rounded once per line
    assert body["total_amount"] == 300 + 90 + 55
    assert body["total_amount"] == sum(line["amount"] for line in body["lines"])
    listing = client.get("/v1/billing/statements", headers=b.headers).json()["data"]
    assert {s["tenant"] for s in listing} == {"globex"}
    assert [s["period"] for s in listing][0] == period and all(s["status"] == "draft" for s in listing)
    mine = client.get("/v1/billing/statements", headers=a.headers).json()["data"]
    assert [(s["period"], s["prompt_tokens"]) for s in mine][1][1] == 1000  # last month's draft
    csv_text = client.get(f"/v1/billing/statements/{period}?format=csv", headers=a.headers).text
    assert csv_text.strip().splitlines()[-1].endswith("total,330,,0.000445")
    assert client.get("/v1/billing/statements/2026-13", headers=a.headers).status_code == 400
    assert client.get("/v1/billing/statements", headers=_admin(admin_key)).status_code == 401


def test_tenant_usage_report_filters_and_never_leaks(client, usage):
    a, b, last_month = usage
    r = client.get("/v1/usage/report?group_by=adapter", headers=a.headers)
    assert r.status_code == 200
    assert r.json()["object"] == "usage_report"
    assert all("day" not in row and "tenant" not in row and "amount_decimal" in row for row in r.json()["data"])
    adapters = {row["adapter"]: row for row in r.json()["data"]}
    assert set(adapters) == {"", "sql@" + "a" * 12}
    only_sql = client.get("/v1/usage/report?adapter=sql&group_by=day", headers=a.headers).json()
    totals = only_sql["totals"]
    assert {k: totals[k] for k in ("requests", "prompt_tokens", "completion_tokens")} == {
        "requests": 1, "prompt_tokens": 100, "completion_tokens": 10}
    assert set(totals["amounts"]) == {only_sql["data"][0]["currency"]}
    last = last_month.date()
    older = client.get(f"/v1/usage/report?start={last}&end={last}", headers=a.headers).json()
    assert older["totals"]["prompt_tokens"] == 1000
    assert client.get("/v1/usage/report?group_by=tenant", headers=a.headers).status_code == 400
    assert client.get("/v1/usage/report?start=2026-02-01&end=2026-01-01", headers=a.headers).status_code == 400
    b_rows = client.get("/v1/usage/report?group_by=adapter", headers=b.headers).json()["data"]
    assert [row["adapter"] for row in b_rows] == ["secret@" + "b" * 12]


def test_admin_report_across_tenants_with_filters_and_csv(client, usage, admin_key):
    a, b, _ = usage
    r = client.get("/admin/api/billing/report?group_by=tenant", headers=_admin(admin_key))
    assert r.status_code == 200
    by_tenant = {row["tenant"]: row for row in r.json()["data"]}
    assert by_tenant["acme"]["prompt_tokens"] == 300 and by_tenant["globex"]["prompt_tokens"] == 5000
    one = client.get(f"/admin/api/billing/report?group_by=tenant,adapter&tenant_id={b.tenant_id}",
                     headers=_admin(admin_key)).json()["data"]
    assert {row["tenant"] for row in one} == {"globex"}
    text = client.get("/admin/api/billing/report?group_by=day,tenant&format=csv", headers=_admin(admin_key)).text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert sum(int(row["prompt_tokens"]) for row in rows) == 5300
    assert client.get("/admin/api/billing/report", headers=a.headers).status_code == 401


def test_admin_finalizes_a_closed_month_and_it_stays_put(client, usage, admin_key):
    a, _, last_month = usage
    period = period_of(last_month.date())
    r = client.post("/admin/api/billing/statements/finalize", headers=_admin(admin_key), json={"period": period})
    assert r.status_code == 200 and r.json()["statements"] == 1  # globex was created after that month
    stmt = client.get(f"/v1/billing/statements/{period}", headers=a.headers).json()
    assert stmt["status"] == "final" and stmt["prompt_tokens"] == 1000
    current = period_of(today_utc())
    refused = client.post("/admin/api/billing/statements/finalize", headers=_admin(admin_key), json={"period": current})
    assert refused.status_code == 400
    listing = client.get(f"/admin/api/billing/statements?period={period}&format=csv", headers=_admin(admin_key))
    assert listing.status_code == 200 and "acme" in listing.text


def test_admin_rollups_are_idempotent_over_http(client, usage, admin_key):
    today = today_utc().isoformat()
    first = client.post("/admin/api/billing/rollups", headers=_admin(admin_key), json={"start": today}).json()
    again = client.post("/admin/api/billing/rollups", headers=_admin(admin_key), json={"start": today}).json()
    assert first == again and first["days"][today] == 3


def test_admin_prices_validation(client, admin_key, usage):
    bad = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key),
                     json={"prompt_price": 0.5, "completion_price": 1, "adapter_surcharge_price": 0})
    assert bad.status_code == 400
    missing = client.put("/admin/api/billing/prices/plans/999", headers=_admin(admin_key),
                         json={"prompt_price": 1, "completion_price": 1, "adapter_surcharge_price": 0})
    assert missing.status_code == 404
    a, _, _ = usage
    ok = client.put(f"/admin/api/billing/tenants/{a.tenant_id}/price-override", headers=_admin(admin_key),
                    json={"completion_price": 7})
    assert ok.status_code == 200
    got = client.get(f"/admin/api/billing/tenants/{a.tenant_id}/price-override", headers=_admin(admin_key)).json()
    assert got["completion_price"] == 7 and got["prompt_price"] is None


def test_v1_usage_filters_by_adapter_and_key_and_exports_csv(client, usage, make_tenant):
    a, _, last_month = usage
    # this month only: the default window (the last 30 days) also holds last month's row early in a month
    since = f"start={today_utc().replace(day=1).isoformat()}"
    rows = client.get(f"/v1/usage?{since}", headers=a.headers).json()["data"]
    assert sum(r["prompt_tokens"] for r in rows) == 300
    default = client.get("/v1/usage", headers=a.headers).json()["data"]
    in_window = (today_utc() - last_month.date()).days < 30
    assert sum(r["prompt_tokens"] for r in default) == (1300 if in_window else 300)
    only = client.get(f"/v1/usage?adapter=sql&{since}", headers=a.headers).json()["data"]
    assert [(r["adapter"], r["prompt_tokens"]) for r in only] == [("sql", 100)]
    assert client.get("/v1/usage?api_key_id=999999", headers=a.headers).json()["data"] == []
    mine = client.get(f"/v1/usage?api_key_id={a.key_id}&{since}", headers=a.headers).json()["data"]
    assert sum(r["requests"] for r in mine) == 2
    text = client.get(f"/v1/usage?format=csv&{since}", headers=a.headers)
    assert text.headers["content-type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(text.text)))
    assert sum(int(r["prompt_tokens"]) for r in parsed) == 300
    # another tenant's adapter is none of this one's: a 404, as for a name nobody uses, never its usage
    assert client.get("/v1/usage?adapter=secret", headers=a.headers).status_code == 404


def test_tenant_statement_list_filters_by_period(client, usage):
    """`period` filters the list, as it does the admin list, instead of being ignored."""
    a, _, last_month = usage
    previous = period_of(last_month.date())
    mine = client.get("/v1/billing/statements", headers=a.headers, params={"period": previous}).json()["data"]
    assert [(s["period"], s["prompt_tokens"]) for s in mine] == [(previous, 1000)]
    assert client.get("/v1/billing/statements", headers=a.headers, params={"period": "1999-01"}).json()["data"] == []
    r = client.get("/v1/billing/statements", headers=a.headers, params={"period": "2026-13"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "period"


@pytest.mark.parametrize("path", ["/v1/billing/statements", "/v1/billing/statements/{period}", "/v1/usage",
                                  "/v1/usage/report"])
def test_tenant_reports_refuse_an_unknown_query_parameter(client, usage, path):
    a, _, _ = usage
    r = client.get(path.format(period=period_of(today_utc())), headers=a.headers, params={"perod": "2026-01"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "perod" and "unknown query parameter 'perod'" in error["message"]
    # the caller's key is checked first: no hint for a caller without one
    assert client.get(path.format(period="2026-01"), params={"perod": "x"}).status_code == 401


@pytest.mark.parametrize("path", ["/admin/api/billing/report", "/admin/api/billing/statements",
                                  "/admin/api/billing/statements/{tenant}/{period}"])
def test_admin_reports_refuse_an_unknown_query_parameter(client, usage, admin_key, path):
    a, _, _ = usage
    url = path.format(tenant=a.tenant_id, period=period_of(today_utc()))
    r = client.get(url, headers=_admin(admin_key), params={"tenant": "acme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    assert client.get(url, headers=_admin(admin_key), params={"format": "json"}).status_code == 200
