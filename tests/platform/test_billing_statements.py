"""Statements and rollups against a real database: exact sums, idempotent rollups, tenant isolation."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import select

from loraplex.platform.billing.aggregate import adapter_label
from loraplex.platform.billing.lines import BASE_MODEL
from loraplex.platform.billing.models import ALWAYS, Statement, UsageRollup
from loraplex.platform.billing.money import line_amount
from loraplex.platform.billing.prices import price_lists, set_plan_price, set_tenant_override, tenant_override
from loraplex.platform.billing.pricing import Price, PriceOverride
from loraplex.platform.billing.reports import usage_report
from loraplex.platform.billing.rollups import rollup_day
from loraplex.platform.billing.statements import (
    compute_statement,
    finalize_period,
    finalize_statement,
    get_statement,
    list_statements,
)
from loraplex.platform.billing.tasks import finalize_last_month
from loraplex.platform.db import Base, import_all_models, make_engine, make_session_factory
from loraplex.platform.models import Plan, Tenant, UsageRecord

NOV = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
def sessions(tmp_path):
    import_all_models()
    engine = make_engine(f"sqlite:///{tmp_path / 'billing.db'}")
    Base.metadata.create_all(engine)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def session(sessions):
    with sessions() as s:
        yield s


def _tenant(session, name, plan=None) -> Tenant:
    t = Tenant(name=name, plan=plan, created_at=datetime(2026, 10, 1, tzinfo=UTC))  # before every month used here
    session.add(t)
    session.flush()
    return t


def _record(session, tenant, *, at, prompt, completion, adapter=None, version=None, key=1, status="ok"):
    session.add(UsageRecord(
        request_id=uuid.uuid4().hex, tenant_id=tenant.id, api_key_id=key, model=adapter or "base",
        adapter_name=adapter, adapter_version=version, endpoint="chat", prompt_tokens=prompt,
        completion_tokens=completion, ttft_ms=5, latency_ms=20, status=status, created_at=at,
    ))


def _random_usage(session, rng, tenants, n, month_start=NOV, days=30):
    adapters = [(None, None), ("sql", "a" * 64), ("sql", "b" * 64), ("chat", "c" * 64)]
    for _ in range(n):
        tenant = rng.choice(tenants)
        name, version = rng.choice(adapters)
        at = month_start + timedelta(seconds=rng.randrange(days * 86400))
        _record(session, tenant, at=at, prompt=rng.randrange(0, 4000), completion=rng.randrange(0, 1000),
                adapter=name, version=version, key=rng.choice([1, 2, None]), status=rng.choice(["ok", "ok", "error"]))
    session.flush()


def _plan(session, name="pro") -> Plan:
    plan = Plan(name=name, requests_per_minute=10, tokens_per_minute=10, max_concurrent=1, monthly_token_budget=10)
    session.add(plan)
    session.flush()
    return plan


def test_statements_equal_the_sum_of_their_usage_records_for_random_usage(session):
    rng = random.Random(20261129)
    plan = _plan(session)
    set_plan_price(session, plan.id, Price(prompt=150_001, completion=600_007, adapter_surcharge=33_333), "2026-11")
    set_plan_price(session, None, Price(prompt=1_000_003, completion=2_000_011, adapter_surcharge=7), "2026-11")
    tenants = [_tenant(session, "acme", plan), _tenant(session, "globex"), _tenant(session, "initech", plan)]
    set_tenant_override(session, tenants[2].id, PriceOverride(completion=999_999), "2026-11")
    _random_usage(session, rng, tenants, 600)
    # noise just outside the month must not leak in
    _record(session, tenants[0], at=NOV - timedelta(microseconds=1), prompt=10**6, completion=10**6)
    _record(session, tenants[0], at=datetime(2026, 12, 1, tzinfo=UTC), prompt=10**6, completion=10**6)
    session.flush()

    for tenant in tenants:
        view = compute_statement(session, tenant, "2026-11")
        records = session.scalars(select(UsageRecord).where(
            UsageRecord.tenant_id == tenant.id, UsageRecord.created_at >= NOV,
            UsageRecord.created_at < datetime(2026, 12, 1, tzinfo=UTC),
        )).all()
        assert view.requests == len(records)
        billed = [r for r in records if r.status != "error"]  # server-side failures are not billed
        assert view.prompt_tokens == sum(r.prompt_tokens for r in billed)
        assert view.completion_tokens == sum(r.completion_tokens for r in billed)
        # every line recomputes from the records behind it, and the total is the sum of the lines
        by_adapter: dict[str, list[int]] = {}
        for r in billed:
            label = adapter_label(r.adapter_name or "", r.adapter_version or "")
            acc = by_adapter.setdefault(label, [0, 0])
            acc[0] += r.prompt_tokens
            acc[1] += r.completion_tokens
        expected_total = 0
        for line in view.lines:
            prompt, completion = by_adapter[line.adapter]
            tokens = {"prompt": prompt, "completion": completion, "adapter_surcharge": prompt + completion}[line.component]
            assert line.tokens == tokens
            assert line.amount == line_amount(tokens, line.unit_price)
            expected_total += line.amount
        assert view.total_amount == expected_total
        assert not any(line.component == "adapter_surcharge" for line in view.lines if line.adapter == BASE_MODEL)
    initech = compute_statement(session, tenants[2], "2026-11")
    assert {line.unit_price for line in initech.lines if line.component == "completion"} == {999_999}
    globex = compute_statement(session, tenants[1], "2026-11")
    assert {line.unit_price for line in globex.lines if line.component == "prompt"} == {1_000_003}


def test_finalized_statements_are_stored_once_and_do_not_change(session):
    rng = random.Random(7)
    set_plan_price(session, None, Price(prompt=500_000, completion=1_500_000, adapter_surcharge=100_000), "2026-11")
    tenants = [_tenant(session, "a"), _tenant(session, "b")]
    _random_usage(session, rng, tenants, 80)
    with pytest.raises(ValueError, match="not closed"):
        finalize_statement(session, tenants[0], "2026-11", now=datetime(2026, 11, 30, 23, tzinfo=UTC))
    after = datetime(2026, 12, 2, tzinfo=UTC)
    assert finalize_period(session, "2026-11", now=after) == 2
    first = get_statement(session, tenants[0], "2026-11")
    assert first.status == "final"
    assert first.total_amount == compute_statement(session, tenants[0], "2026-11").total_amount
    dearer = Price(prompt=9_000_000, completion=9_000_000, adapter_surcharge=9_000_000)
    # a billed month's prices are closed: its reports would disagree with its statement
    with pytest.raises(ValueError, match="2026-11 are final; a price change may apply from 2026-12"):
        set_plan_price(session, None, dearer, "2026-11")
    with pytest.raises(ValueError, match="are final"):
        set_tenant_override(session, tenants[0].id, PriceOverride(prompt=1), "2026-10")
    set_plan_price(session, None, dearer, "2026-12")
    set_tenant_override(session, tenants[1].id, PriceOverride(prompt=1), "2026-12")
    finalize_period(session, "2026-11", now=after)  # re-running is harmless
    again = get_statement(session, tenants[0], "2026-11")
    assert again.total_amount == first.total_amount
    assert [(x.tokens, x.amount) for x in again.lines] == [(x.tokens, x.amount) for x in first.lines]
    assert len(session.scalars(select(Statement)).all()) == 2


def test_rollups_are_idempotent_and_match_records(session):
    rng = random.Random(3)
    tenants = [_tenant(session, "a"), _tenant(session, "b")]
    _random_usage(session, rng, tenants, 300, days=3)
    day = date(2026, 11, 2)

    def snapshot():
        rows = session.scalars(select(UsageRollup).where(UsageRollup.day == day)).all()
        return sorted((r.tenant_id, r.api_key_id, r.adapter_name, r.adapter_version, r.requests,
                       r.failed_requests, r.prompt_tokens, r.completion_tokens, r.latency_ms_total) for r in rows)

    rollup_day(session, day)
    first = snapshot()
    rollup_day(session, day)
    rollup_day(session, day)
    assert snapshot() == first
    records = session.scalars(select(UsageRecord).where(
        UsageRecord.created_at >= datetime(2026, 11, 2, tzinfo=UTC),
        UsageRecord.created_at < datetime(2026, 11, 3, tzinfo=UTC))).all()
    assert sum(r[4] for r in first) == len(records)
    assert sum(r[6] for r in first) == sum(r.prompt_tokens for r in records if r.status != "error")
    assert sum(r[5] for r in first) == sum(r.status == "error" for r in records)
    # a late record is picked up by the next run, replacing rather than adding rows
    _record(session, tenants[0], at=datetime(2026, 11, 2, 12, tzinfo=UTC), prompt=5, completion=5)
    session.flush()
    rollup_day(session, day)
    assert sum(r[4] for r in snapshot()) == len(records) + 1


def test_reports_agree_whether_days_are_rolled_up_or_live(session):
    rng = random.Random(11)
    set_plan_price(session, None, Price(prompt=123_457, completion=765_433, adapter_surcharge=11), "2026-11")
    tenants = [_tenant(session, "a"), _tenant(session, "b")]
    _random_usage(session, rng, tenants, 200, days=10)
    start, end = date(2026, 11, 1), date(2026, 11, 10)
    dims = ("day", "tenant", "key", "adapter")
    live = [r.as_dict(dims) for r in usage_report(session, start, end, group_by=dims)]
    for d in range(1, 11):
        rollup_day(session, date(2026, 11, d))
    rolled = [r.as_dict(dims) for r in usage_report(session, start, end, group_by=dims)]
    assert rolled == live
    assert sum(r["requests"] for r in live) == 200
    by_tenant = usage_report(session, start, end, group_by=("tenant",))
    assert sum(r.prompt_tokens for r in by_tenant) == sum(r["prompt_tokens"] for r in live)


def test_a_tenant_never_sees_another_tenants_usage_or_statements(session):
    rng = random.Random(5)
    a, b = _tenant(session, "a"), _tenant(session, "b")
    _random_usage(session, rng, [a], 30)
    _record(session, b, at=NOV + timedelta(days=1), prompt=777, completion=333, adapter="secret", version="d" * 64)
    session.flush()
    rows = usage_report(session, date(2026, 11, 1), date(2026, 11, 30), group_by=("adapter",), tenant_ids=[a.id])
    assert all(r.adapter is None or not r.adapter.startswith("secret") for r in rows)
    assert sum(r.requests for r in rows) == 30
    view = compute_statement(session, a, "2026-11")
    assert all(not line.adapter.startswith("secret") for line in view.lines)
    finalize_period(session, "2026-11", now=datetime(2026, 12, 5, tzinfo=UTC))
    assert [s.tenant_id for s in list_statements(session, tenant_ids=[a.id])] == [a.id]
    b_view = get_statement(session, b, "2026-11")
    assert (b_view.prompt_tokens, b_view.completion_tokens) == (777, 333)


def test_report_refuses_unknown_grouping(session):
    with pytest.raises(ValueError, match="cannot group"):
        usage_report(session, date(2026, 11, 1), date(2026, 11, 2), group_by=("planet",))


def test_the_periodic_task_finalizes_last_month_only_after_the_grace_period(sessions):
    with sessions() as s:
        tenant = _tenant(s, "a")
        _record(s, tenant, at=NOV + timedelta(days=3), prompt=10, completion=5)
        s.commit()
    assert finalize_last_month(sessions, now=datetime(2026, 12, 1, 0, 30, tzinfo=UTC)) == 0
    assert finalize_last_month(sessions, now=datetime(2026, 12, 1, 2, tzinfo=UTC)) == 1
    assert finalize_last_month(sessions, now=datetime(2026, 12, 2, tzinfo=UTC)) == 1  # a rerun keeps it
    with sessions() as s:
        rows = s.scalars(select(Statement)).all()
        assert [(r.period, r.prompt_tokens, r.status) for r in rows] == [("2026-11", 10, "final")]


def test_each_month_is_priced_with_the_prices_in_force_for_it(session):
    tenant = _tenant(session, "a")
    oct_day, nov_day = datetime(2026, 10, 15, tzinfo=UTC), datetime(2026, 11, 15, tzinfo=UTC)
    _record(session, tenant, at=oct_day, prompt=1_000_000, completion=0)
    _record(session, tenant, at=nov_day, prompt=1_000_000, completion=0)
    set_plan_price(session, None, Price(prompt=2_000_000, completion=0, adapter_surcharge=0), ALWAYS)
    set_plan_price(session, None, Price(prompt=3_000_000, completion=0, adapter_surcharge=0), "2026-11")
    set_plan_price(session, None, Price(prompt=5_000_000, completion=0, adapter_surcharge=0), "2027-01")
    assert compute_statement(session, tenant, "2026-10").total_amount == 2_000_000
    assert compute_statement(session, tenant, "2026-11").total_amount == 3_000_000
    set_tenant_override(session, tenant.id, PriceOverride(prompt=1_000_000), "2026-11")
    assert compute_statement(session, tenant, "2026-11").total_amount == 1_000_000
    assert compute_statement(session, tenant, "2026-10").total_amount == 2_000_000
    set_tenant_override(session, tenant.id, None, "2026-12")  # the override ends with November
    assert tenant_override(session, tenant.id, "2026-12") is None
    assert tenant_override(session, tenant.id, "2026-11") == PriceOverride(prompt=1_000_000)
    rows = usage_report(session, date(2026, 10, 1), date(2026, 11, 30), group_by=("day",))
    assert [(r.day, r.amount) for r in rows] == [(oct_day.date(), 2_000_000), (nov_day.date(), 1_000_000)]
    lists = {p["plan"]: p for p in price_lists(session, "2026-11")}
    assert lists["(no plan)"]["price"].prompt == 3_000_000 and lists["(no plan)"]["scheduled"] == ["2027-01"]


def test_tenants_created_after_a_month_get_no_statement_for_it(session):
    old = Tenant(name="old", created_at=datetime(2026, 11, 2, tzinfo=UTC))
    late = Tenant(name="late", created_at=datetime(2026, 12, 15, tzinfo=UTC))
    session.add_all([old, late])
    session.flush()
    assert finalize_period(session, "2026-11", now=datetime(2026, 12, 20, tzinfo=UTC)) == 1
    assert [s.tenant_id for s in list_statements(session, period="2026-11")] == [old.id]


def test_requests_that_failed_on_the_server_are_counted_but_not_billed(session):
    """A request the server failed (the engine lost mid-request, say) is a failed request in the reports; its
    tokens are not billed: the client got no answer, or one cut short by the server."""
    tenant = _tenant(session, "acme")
    _record(session, tenant, at=NOV + timedelta(days=1), prompt=100, completion=50)
    _record(session, tenant, at=NOV + timedelta(days=1, hours=1), prompt=39, completion=123, status="error")
    _record(session, tenant, at=NOV + timedelta(days=1, hours=2), prompt=10, completion=4, status="cancelled")
    session.flush()
    view = compute_statement(session, tenant, "2026-11")
    assert view.requests == 3
    assert (view.prompt_tokens, view.completion_tokens) == (110, 54)  # the cancelled one's delivered tokens count
    rows = usage_report(session, date(2026, 11, 1), date(2026, 11, 30), tenant_ids=[tenant.id])
    assert sum(r.failed_requests for r in rows) == 1 and sum(r.requests for r in rows) == 3
    assert sum(r.prompt_tokens for r in rows) == 110


def test_a_report_over_a_whole_month_is_the_statement_to_the_micro_unit(session):
    """Reports round as statements do (each adapter and component, then a sum): a tenant's row over a month is
    its statement's amount, and the rows split by adapter add up to it. Rounding each row's exact sum once
    used to leave them a micro-unit apart."""
    rng = random.Random(11)
    tenants = [_tenant(session, "a"), _tenant(session, "b")]
    _random_usage(session, rng, tenants, 400, days=30)
    # half a micro-unit on each of two lines: 1 + 1 once each line is rounded, 1 if only the sum were
    set_plan_price(session, None, Price(prompt=500_000, completion=500_000, adapter_surcharge=0), "2026-11")
    for tenant in tenants:
        _record(session, tenant, at=NOV + timedelta(days=3), prompt=1, completion=1, adapter="tiny", version="ab" * 32)
    session.flush()
    by_tenant = {r.tenant_id: r.amount for r in usage_report(
        session, date(2026, 11, 1), date(2026, 11, 30), group_by=("tenant",))}
    by_adapter = usage_report(session, date(2026, 11, 1), date(2026, 11, 30), group_by=("tenant", "adapter"))
    for tenant in tenants:
        statement = compute_statement(session, tenant, "2026-11")
        assert by_tenant[tenant.id] == statement.total_amount
        assert sum(r.amount for r in by_adapter if r.tenant_id == tenant.id) == statement.total_amount


def _dollar_and_euro_tenants(session):
    """Tenant d on the default list in USD, tenant e on a plan priced in EUR (twice d's rate), one million
    prompt tokens each on 2026-11-03."""
    euro_plan = Plan(name="euro", requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2,
                     monthly_token_budget=10_000)
    session.add(euro_plan)
    session.flush()
    set_plan_price(session, None, Price(prompt=1_000_000, completion=1_000_000, adapter_surcharge=0), "2026-11")
    set_plan_price(session, euro_plan.id, Price(prompt=2_000_000, completion=2_000_000, adapter_surcharge=0,
                                                 currency="EUR"), "2026-11")
    dollars, euros = _tenant(session, "d"), _tenant(session, "e", plan=euro_plan)
    _record(session, dollars, at=NOV + timedelta(days=2), prompt=1_000_000, completion=0)
    _record(session, euros, at=NOV + timedelta(days=2, hours=1), prompt=1_000_000, completion=0)
    return dollars, euros


def test_amounts_in_different_currencies_are_never_added(session):
    """A plan priced in EUR beside the default list in USD: a report row over both tenants has an amount per
    currency and no single amount; rows of one tenant keep theirs."""
    _dollar_and_euro_tenants(session)
    session.flush()
    (day,) = usage_report(session, date(2026, 11, 1), date(2026, 11, 30), group_by=("day",))
    assert day.currency == "mixed" and day.amounts == {"USD": 1_000_000, "EUR": 2_000_000}
    assert day.as_dict(("day",))["amount"] is None
    rows = usage_report(session, date(2026, 11, 1), date(2026, 11, 30), group_by=("tenant",))
    assert {(r.tenant, r.currency, r.as_dict(("tenant",))["amount"]) for r in rows} == {
        ("d", "USD", 1_000_000), ("e", "EUR", 2_000_000)}


def test_a_report_over_several_currencies_renders_as_json_and_csv(session):
    """The API's JSON and the CSV export of such a report: the mixed row has no one amount and its amount
    per currency; the totals add up each currency on its own."""
    import json

    from loraplex.platform.billing.responses import report_response

    _, euros = _dollar_and_euro_tenants(session)
    _record(session, euros, at=NOV + timedelta(days=3), prompt=500_000, completion=0)
    session.flush()
    start, end = date(2026, 11, 1), date(2026, 11, 30)
    rows = usage_report(session, start, end, group_by=("day",))
    response = report_response(rows, ("day",), start, end, "json", "usage")
    assert response.status_code == 200
    body = json.loads(response.body)
    mixed, euro_only = body["data"]
    assert mixed["currency"] == "mixed" and mixed["amount"] is None and mixed["amount_decimal"] is None
    assert mixed["amounts"] == {"EUR": 2_000_000, "USD": 1_000_000}
    assert mixed["amounts_decimal"] == {"EUR": "2.000000", "USD": "1.000000"}
    assert euro_only["amount"] == 1_000_000 and euro_only["currency"] == "EUR"
    assert body["totals"]["amounts"] == {"EUR": 3_000_000, "USD": 1_000_000}
    assert body["totals"]["amounts_decimal"] == {"EUR": "3.000000", "USD": "1.000000"}
    csv_text = report_response(rows, ("day",), start, end, "csv", "usage").body.decode()
    header, first, second = csv_text.strip().splitlines()
    assert header.endswith("amount,currency,amounts")
    assert first.endswith(",mixed,EUR 2.000000; USD 1.000000") and second.endswith("1.000000,EUR,EUR 1.000000")


def test_a_rollup_made_while_its_day_ran_is_not_taken_for_the_days_total(session):
    """The hourly task rolls today up too: such a rollup holds the day's first hours only. If no later run
    replaced it, reports sum that day live (and agree with the statement) instead of reading it."""
    from loraplex.platform.billing.models import RollupRun

    tenant = _tenant(session, "a")
    day = date(2026, 11, 2)
    _record(session, tenant, at=datetime(2026, 11, 2, 9, tzinfo=UTC), prompt=10, completion=1)
    session.flush()
    rollup_day(session, day)
    session.get(RollupRun, day).rolled_at = datetime(2026, 11, 2, 10, tzinfo=UTC)  # made that morning
    _record(session, tenant, at=datetime(2026, 11, 2, 15, tzinfo=UTC), prompt=20, completion=2)
    session.flush()

    def prompt_tokens():
        (row,) = usage_report(session, day, day, group_by=("tenant",))
        return row.prompt_tokens

    assert prompt_tokens() == 30
    assert compute_statement(session, tenant, "2026-11").prompt_tokens == 30
    # one made after the day was over is the day's total, and is what reports read
    rollup_day(session, day)
    session.get(RollupRun, day).rolled_at = datetime(2026, 11, 3, 2, tzinfo=UTC)
    session.flush()
    assert prompt_tokens() == 30
    (rolled,) = session.scalars(select(UsageRollup).where(UsageRollup.day == day)).all()
    rolled.prompt_tokens = 31  # a mark: reports read the rollup, not the records
    session.flush()
    assert prompt_tokens() == 31
