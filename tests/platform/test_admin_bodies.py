"""Admin request bodies: a misspelt or unknown field is refused by name instead of silently dropped; a missing
one is named as missing; rollups refuse days that have not begun and dates at the end of the calendar; ids
past what the database holds and periods no statement can cover are refused by name."""

from __future__ import annotations

from datetime import timedelta

import pytest
from click.testing import CliRunner

from loraplex.cli import main
from loraplex.platform.billing.periods import today_utc

PLAN = {"name": "gold", "requests_per_minute": 10, "tokens_per_minute": 100, "max_concurrent": 2,
        "monthly_token_budget": 1000}


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("post", "/admin/api/tenants", {"name": "acme", "plan_id": 1}, "plan_id"),
    ("post", "/admin/api/plans", {**PLAN, "rpm": 5}, "rpm"),
    ("post", "/admin/api/tenants/{tenant}/keys", {"name": "k", "scope": ["inference"]}, "scope"),
    ("put", "/admin/api/billing/prices/default",
     {"prompt_price": 1, "completion_price": 1, "adapter_surcharge_price": 0, "currncy": "EUR"}, "currncy"),
    ("put", "/admin/api/billing/tenants/{tenant}/price-override", {"completion": 7}, "completion"),
    ("post", "/admin/api/billing/statements/finalize", {"period": "2026-10", "force": True}, "force"),
    ("post", "/admin/api/billing/rollups", {"start": "2026-10-01", "until": "2026-10-02"}, "until"),
])
def test_unknown_fields_are_refused_by_name(client, admin_key, make_tenant, method, path, body, field):
    tenant = make_tenant()
    r = getattr(client, method)(path.format(tenant=tenant.tenant_id), headers=_admin(admin_key), json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert err["message"] == f"Unrecognized request argument supplied: '{field}'"


def test_nothing_is_created_by_a_refused_body(client, admin_key):
    h = _admin(admin_key)
    assert client.post("/admin/api/tenants", headers=h, json={"name": "acme", "plan_id": 1}).status_code == 400
    assert [t["name"] for t in client.get("/admin/api/tenants", headers=h).json()] == []
    # the same body with the field spelt right goes through
    assert client.post("/admin/api/plans", headers=h, json=PLAN).status_code == 201
    r = client.post("/admin/api/tenants", headers=h, json={"name": "acme", "plan": "gold"})
    assert r.status_code == 201 and r.json()["plan"] == "gold"


@pytest.mark.parametrize(("path", "body"), [
    ("/admin/api/tenants", '{"name": "acme\\ud800"}'),
    ("/admin/api/plans", '{"name": "\\udfff", "requests_per_minute": 1, "tokens_per_minute": 1, '
                         '"max_concurrent": 1, "monthly_token_budget": 1}'),
])
def test_a_lone_surrogate_is_named_as_such(client, admin_key, path, body):
    """A JSON escape of half a surrogate pair, in a field with a pattern or a length bound, is refused in words
    (pydantic says "unable to parse raw data as a unicode string")."""
    r = client.post(path, headers={**_admin(admin_key), "content-type": "application/json"}, content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "name"
    assert err["message"].startswith("Invalid value for 'name': is not valid Unicode text: it holds a lone "
                                     "surrogate (U+D"), err


def test_a_missing_field_is_named_as_missing(client, admin_key, make_tenant):
    r = client.post("/admin/api/plans", headers=_admin(admin_key), json={"name": "p"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "requests_per_minute"
    assert err["message"].startswith("Missing required parameter: 'requests_per_minute'")
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Missing required parameter: 'model'"


def test_rollups_refuse_days_not_begun_and_the_last_date(client, admin_key):
    h = _admin(admin_key)
    tomorrow = (today_utc() + timedelta(days=1)).isoformat()
    r = client.post("/admin/api/billing/rollups", headers=h, json={"start": tomorrow})
    assert r.status_code == 400 and "has not begun yet" in r.json()["error"]["message"]
    r = client.post("/admin/api/billing/rollups", headers=h,
                    json={"start": today_utc().isoformat(), "end": tomorrow})
    assert r.status_code == 400 and tomorrow in r.json()["error"]["message"]
    r = client.post("/admin/api/billing/rollups", headers=h, json={"start": "9999-12-31"})
    assert r.status_code == 400 and "before 9999-12-31" in r.json()["error"]["message"]
    r = client.get("/admin/api/billing/report?start=9999-06-01&end=9999-12-31", headers=h)
    assert r.status_code == 400 and "before 9999-12-31" in r.json()["error"]["message"]
    today = today_utc().isoformat()
    r = client.post("/admin/api/billing/rollups", headers=h, json={"start": today})
    assert r.status_code == 200 and r.json() == {"days": {today: 0}}


def test_rollup_command_refuses_a_day_not_begun(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    tomorrow = (today_utc() + timedelta(days=1)).isoformat()
    r = CliRunner().invoke(main, ["admin", "billing", "rollup", tomorrow], env=env)
    assert r.exit_code == 2 and "has not begun yet" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["admin", "billing", "rollup", "9999-12-31"], env=env)
    assert r.exit_code == 2 and "before 9999-12-31" in r.output


HUGE = 5083142211507275694080  # past SQLite's 64-bit integers


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("put", "/admin/api/billing/prices/default",
     {"prompt_price": 0, "completion_price": 0, "adapter_surcharge_price": 0, "effective_period": "0000-01"},
     "effective_period"),
    ("put", "/admin/api/billing/tenants/{tenant}/price-override", {"prompt_price": 0, "effective_period": "0000-01"},
     "effective_period"),
    ("post", "/admin/api/billing/statements/finalize", {"period": "0000-12"}, "period"),
    ("put", f"/admin/api/billing/prices/plans/{HUGE}",
     {"prompt_price": 0, "completion_price": 0, "adapter_surcharge_price": 0}, "plan_id"),
    ("put", f"/admin/api/billing/tenants/{HUGE}/price-override", {"prompt_price": 0}, "tenant_id"),
    ("get", f"/admin/api/billing/statements?tenant_id={HUGE}&format=csv", None, "tenant_id[0]"),
    ("get", f"/admin/api/billing/report?api_key_id={HUGE}", None, "api_key_id"),
    ("get", f"/admin/api/billing/statements/{HUGE}/2026-10", None, "tenant_id"),
    ("get", f"/admin/api/adapters?tenant_id={HUGE}", None, "tenant_id"),
    ("get", "/admin/api/adapters?tenant_id=0", None, "tenant_id"),
])
def test_ids_and_periods_out_of_range_are_refused_by_name(client, admin_key, make_tenant, method, path, body, param):
    tenant = make_tenant()
    kwargs = {"json": body} if body is not None else {}
    r = getattr(client, method)(path.format(tenant=tenant.tenant_id), headers=_admin(admin_key), **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    # nothing was priced
    assert client.get("/admin/api/billing/prices", headers=_admin(admin_key)).json()["data"][0]["price"] is None


@pytest.mark.parametrize("path", ["/v1/usage?api_key_id={huge}", "/v1/usage/report?api_key_id={huge}"])
def test_a_tenant_usage_filter_past_the_database_ids_is_refused(client, make_tenant, path):
    tenant = make_tenant()
    r = client.get(path.format(huge=HUGE), headers=tenant.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "api_key_id", r.text


def test_an_empty_key_name_is_refused(client, admin_key, make_tenant):
    tenant = make_tenant()
    r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key), json={"name": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/keys", headers=_admin(admin_key), json={})
    assert r.status_code == 201 and r.json()["name"] == "default", r.text
