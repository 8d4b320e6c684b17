"""What usage and billing reports take as input: days as YYYY-MM-DD only, group_by names once each, and an
adapter filter written as the `model` field is (name, name@version) or empty for the base model."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from loraplex.platform.billing.periods import today_utc
from loraplex.platform.db import session_scope
from loraplex.platform.models import UsageRecord

V1, V2 = "a" * 12 + "1" * 52, "a" * 6 + "b" * 58  # two versions of one adapter, sharing six hex digits


@pytest.fixture
def usage(app, make_tenant):
    """acme: base-model usage and two versions of `sql` today; globex: its own `secret` adapter."""
    a, b = make_tenant("acme"), make_tenant("globex")
    now = datetime.now(UTC)
    rows = [(a, 100, None, None), (a, 20, "sql", V1), (a, 3, "sql", V2), (b, 5000, "secret", "c" * 64)]
    with session_scope(app.state.services.sessions) as s:
        for tenant, prompt, name, version in rows:
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                              model=name or "base", adapter_name=name, adapter_version=version, endpoint="chat",
                              prompt_tokens=prompt, completion_tokens=1, ttft_ms=1, latency_ms=10, status="ok",
                              created_at=now))
    return a, b


def _admin(admin_key):
    return {"Authorization": f"Bearer {admin_key}"}


def _error(r, status):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


def test_report_days_are_yyyy_mm_dd_only(client, usage, admin_key):
    a, _ = usage
    today = today_utc().isoformat()
    for url, headers in (("/v1/usage/report", a.headers), ("/admin/api/billing/report", _admin(admin_key)),
                         ("/v1/usage", a.headers)):
        assert client.get(f"{url}?start={today}&end={today}", headers=headers).status_code == 200
        for value, words in [("2026-01-01T00:00:00+02:00", "no time or time zone offset"),
                             ("2026-01-01T00:00:00", "no time or time zone offset"),
                             ("1767225600", "not a number or a Unix timestamp"),
                             ("20260101", "YYYY-MM-DD"), ("2026-W01-1", "YYYY-MM-DD"), ("2026-1-1", "YYYY-MM-DD"),
                             ("2026-02-30", "a day of the calendar")]:
            for name in ("start", "end"):
                error = _error(client.get(url, params={name: value}, headers=headers), 400)
                assert error["param"] == name and words in error["message"], (url, value, error)
                assert "YYYY-MM-DD" in error["message"]
        error = _error(client.get(f"{url}?start=2026-02-01&end=2026-01-01", headers=headers), 400)
        assert "2026-02-01 is after end 2026-01-01" in error["message"], error
    for body in ({"start": 1767225600}, {"start": "2026-01-01T00:00:00+05:00"}, {"start": today, "end": "2026/01/02"}):
        error = _error(client.post("/admin/api/billing/rollups", headers=_admin(admin_key), json=body), 400)
        assert "YYYY-MM-DD" in error["message"], (body, error)


def test_group_by_names_each_dimension_once(client, usage, admin_key):
    a, _ = usage
    for url, headers in (("/v1/usage/report", a.headers), ("/admin/api/billing/report", _admin(admin_key))):
        r = client.get(f"{url}?group_by=day,day,adapter,day", headers=headers)
        assert r.status_code == 200 and r.json()["group_by"] == ["day", "adapter"], r.text
        csv_head = client.get(f"{url}?group_by=adapter,adapter&format=csv", headers=headers).text.splitlines()[0]
        assert csv_head.split(",").count("adapter") == 1
        error = _error(client.get(f"{url}?group_by=day,weekday", headers=headers), 400)
        assert error["param"] == "group_by" and "weekday" in error["message"] and "choose from" in error["message"]


def test_adapter_filter_takes_name_version_or_empty_for_the_base_model(client, usage, admin_key):
    a, b = usage

    def prompt_tokens(url, headers, adapter):
        r = client.get(url, params={"adapter": adapter}, headers=headers)
        assert r.status_code == 200, (url, adapter, r.text)
        body = r.json()
        return body["totals"]["prompt_tokens"] if "totals" in body else sum(d["prompt_tokens"] for d in body["data"])

    for url, headers in (("/v1/usage/report", a.headers), ("/v1/usage", a.headers),
                         ("/admin/api/billing/report", _admin(admin_key))):
        assert prompt_tokens(url, headers, "") == 100  # the base model alone
        assert prompt_tokens(url, headers, "sql") == 23  # every version
        assert prompt_tokens(url, headers, f"sql@{V1[:12]}") == 20  # as the report labels it
        assert prompt_tokens(url, headers, f"sql@{V2[:8].upper()}") == 3
        for adapter, status, words in [("nope", 404, "There is no adapter 'nope'"),
                                       ("sql@ffffffff", 404, "no version of adapter 'sql'"),
                                       ("sql@aaaaaa", 400, "ambiguous"), ("sql@abc", 400, "at least 6 hex digits"),
                                       ("sql@zzzzzzzz", 400, "hex digits"), ("@aaaaaaaa", 400, "names no adapter"),
                                       ("x" * 300, 404, "There is no adapter")]:
            error = _error(client.get(url, params={"adapter": adapter}, headers=headers), status)
            assert error["param"] == "adapter" and words in error["message"], (url, adapter, error)
    # another tenant's adapter is no adapter of this one's, and its name is not confirmed
    error = _error(client.get("/v1/usage/report?adapter=secret", headers=a.headers), 404)
    assert error["code"] == "adapter_not_found"
    assert prompt_tokens("/admin/api/billing/report", _admin(admin_key), "secret") == 5000
    scoped = client.get(f"/admin/api/billing/report?adapter=secret&tenant_id={a.tenant_id}", headers=_admin(admin_key))
    assert scoped.status_code == 404
    # a tenant is told about its own adapters; an operator about the tenant's, never "you have"
    assert "There is no adapter 'secret': you have no adapter" in scoped_error(client, "/v1/usage/report", a.headers)
    message = scoped.json()["error"]["message"]
    assert "the tenant has no adapter" in message and "you have" not in message, message


def scoped_error(client, url, headers) -> str:
    return _error(client.get(url, params={"adapter": "secret"}, headers=headers), 404)["message"]


def test_months_are_yyyy_mm_only(client, usage, admin_key):
    """A month with a trailing newline read as the month (a regex's `$` matches before one) and reached a file
    name in a header."""
    a, _ = usage
    for value in ("2026-01%0A", "2026-1", "2026-01-01", "202601", "2026-13"):
        for url, headers in ((f"/v1/billing/statements/{value}?format=csv", a.headers),
                             (f"/admin/api/billing/statements?period={value}&format=csv", _admin(admin_key)),
                             (f"/admin/api/billing/statements/{a.tenant_id}/{value}", _admin(admin_key)),
                             (f"/admin/api/billing/prices?period={value}", _admin(admin_key))):
            error = _error(client.get(url, headers=headers), 400)
            assert "2026-01" in error["message"] and error["param"] == "period", (url, error)
    r = client.put("/admin/api/billing/prices/default", headers=_admin(admin_key),
                   json={"prompt_price": 1, "completion_price": 1, "adapter_surcharge_price": 0,
                         "effective_period": "2026-01\n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "effective_period", r.text


def test_admin_api_prices_are_whole_micro_units_and_refused_in_words(client, usage, admin_key):
    """The admin API takes integer micro-units: exponents, NaN, fractions, text, negatives and amounts past a
    billion units per million tokens are refused with a message naming the field, never a 500."""
    a, _ = usage
    headers = _admin(admin_key) | {"content-type": "application/json"}
    for raw, words in [("1e999999", "too large for a 64-bit float"), ("NaN", "JSON has no NaN"),
                       ("Infinity", "JSON has no NaN"), ("1e3", "valid integer"), ("0.5", "valid integer"),
                       ('"0.25"', "valid integer"), ("-1", "greater than or equal to 0"), (str(10**15 + 1), "less than or equal to"),
                       ("9" * 5000, "more than 4300 digits")]:
        for url, field in (("/admin/api/billing/prices/default", "prompt_price"),
                           (f"/admin/api/billing/tenants/{a.tenant_id}/price-override", "completion_price")):
            body = {"prompt_price": "1", "completion_price": "1", "adapter_surcharge_price": "0"} | {field: raw}
            text = "{" + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}"
            error = _error(client.put(url, headers=headers, content=text), 400)
            assert words in error["message"], (url, raw, error)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_adapter_filter_lookups_on_each_database(kind, tmp_path):
    """An adapter is known by its row, its usage records or its rollups (a deleted adapter's usage still
    names it); versions match as prefixes of the content hash; each tenant sees only its own."""
    from datetime import timedelta

    from platform_helpers import migrated_sessions

    from loraplex.platform.billing.adapter_filter import UnknownAdapter, check_known, parse_adapter_filter
    from loraplex.platform.billing.models import UsageRollup
    from loraplex.platform.models import Adapter, AdapterVersion
    from loraplex.platform.schemas.tenants import TenantCreate
    from loraplex.platform.tenants import create_tenant
    from loraplex.platform.usage.report import usage_by_day

    with migrated_sessions(kind, tmp_path, "lpx_afilter") as sessions, sessions() as s:
        a = create_tenant(s, TenantCreate(name="acme")).id
        b = create_tenant(s, TenantCreate(name="globex")).id
        adapter = Adapter(tenant_id=a, name="live")
        s.add(adapter)
        s.flush()
        s.add(AdapterVersion(adapter_id=adapter.id, tenant_id=a, status="ready", upload_sha256="0" * 64,
                             upload_filename="a.zip", upload_bytes=1, content_hash=V1))
        today = today_utc()
        s.add(UsageRollup(day=today - timedelta(days=40), tenant_id=a, adapter_name="gone", adapter_version=V2,
                          requests=1, failed_requests=0, prompt_tokens=1, completion_tokens=1, latency_ms_total=1))
        for name, version in ((None, None), ("spent", V1)):
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=a, api_key_id=None, model=name or "base",
                              adapter_name=name, adapter_version=version, endpoint="chat", prompt_tokens=7,
                              completion_tokens=1, ttft_ms=1, latency_ms=1, status="ok", created_at=datetime.now(UTC)))
        s.flush()
        for text in ("", "live", f"live@{V1[:6]}", "gone", f"gone@{V2[:12]}", "spent", f"spent@{V1[:40]}"):
            check_known(s, parse_adapter_filter(text), [a])
            check_known(s, parse_adapter_filter(text), None)
        for text in ("nope", f"live@{V2[:12]}", "live@ffffff", "gone@ffffff", "100%_live"):
            with pytest.raises(UnknownAdapter):
                check_known(s, parse_adapter_filter(text), [a])
        for text in ("live", "gone", "spent"):
            with pytest.raises(UnknownAdapter):
                check_known(s, parse_adapter_filter(text), [b])
        base = usage_by_day(s, a, today, today, adapter=parse_adapter_filter(""))
        assert [(r.adapter, r.prompt_tokens) for r in base] == [(None, 7)]
        spent = usage_by_day(s, a, today, today, adapter=parse_adapter_filter(f"spent@{V1[:12].upper()}"))
        assert [(r.adapter, r.prompt_tokens) for r in spent] == [("spent", 7)]
        s.rollback()
