"""Periods whose month bounds fall outside the calendar datetime can hold are a 400, not a 500."""

from __future__ import annotations

import pytest

from loraplex.platform.billing.periods import parse_period, period_bounds


@pytest.mark.parametrize("period", ["0000-01", "9999-12", "9999-01"])
def test_statement_for_an_unrepresentable_period_is_a_400(client, make_tenant, period):
    tenant = make_tenant()
    r = client.get(f"/v1/billing/statements/{period}", headers=tenant.headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "period" and "0001 and 9998" in err["message"]
    assert r.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize(("period", "bounds"), [("0001-01", ("0001-01-01", "0001-02-01")),
                                                ("9998-12", ("9998-12-01", "9999-01-01"))])
def test_extreme_periods_that_fit_have_bounds(period, bounds):
    assert parse_period(period) == (int(period[:4]), int(period[5:]))
    assert tuple(d.isoformat() for d in period_bounds(period)) == bounds
