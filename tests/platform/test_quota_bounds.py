"""Quota numbers larger than their database columns are refused with a 400, not a database error (500)."""

from __future__ import annotations

import pytest

PLAN = {"name": "big", "requests_per_minute": 10, "tokens_per_minute": 10, "max_concurrent": 1,
        "monthly_token_budget": 10}


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("field", "value"), [
    ("requests_per_minute", 2**31), ("tokens_per_minute", 10**20), ("max_concurrent", 2**31),
    ("monthly_token_budget", 2**63),
])
def test_oversized_quota_is_a_400_naming_the_field(client, admin_key, field, value):
    h = _admin(admin_key)
    r = client.post("/admin/api/plans", headers=h, json={**PLAN, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    r = client.post("/admin/api/tenants", headers=h, json={"name": "t1", field: value})
    assert r.status_code == 400, r.text
    r = client.post("/admin/api/tenants", headers=h, json={"name": "t1"})
    assert r.status_code == 201
    r = client.patch(f"/admin/api/tenants/{r.json()['id']}", headers=h, json={field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_largest_storable_quotas_are_kept(client, admin_key):
    h = _admin(admin_key)
    limits = {"requests_per_minute": 2**31 - 1, "tokens_per_minute": 2**31 - 1, "max_concurrent": 2**31 - 1,
              "monthly_token_budget": 2**63 - 1}
    r = client.post("/admin/api/plans", headers=h, json={**PLAN, **limits})
    assert r.status_code == 201, r.text
    r = client.post("/admin/api/tenants", headers=h, json={"name": "t2", "plan": "big"})
    assert r.status_code == 201, r.text
    assert r.json()["quotas"] == limits
