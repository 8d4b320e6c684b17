"""The billing checks again on the machine's PostgreSQL (its own schema, migrated with Alembic)."""

from __future__ import annotations

import uuid

import pytest
import test_billing_statements as on_sqlite
from platform_helpers import postgres_schema

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pg_sessions():
    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.migrate import upgrade_to_head

    with postgres_schema("lpx_bill") as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        yield make_session_factory(engine)
        engine.dispose()


@pytest.fixture
def session(pg_sessions):
    with pg_sessions() as s:
        yield s
        s.rollback()  # each test's rows vanish with its transaction


@pytest.mark.parametrize("check", [
    on_sqlite.test_statements_equal_the_sum_of_their_usage_records_for_random_usage,
    on_sqlite.test_finalized_statements_are_stored_once_and_do_not_change,
    on_sqlite.test_rollups_are_idempotent_and_match_records,
    on_sqlite.test_reports_agree_whether_days_are_rolled_up_or_live,
    on_sqlite.test_a_tenant_never_sees_another_tenants_usage_or_statements,
    on_sqlite.test_each_month_is_priced_with_the_prices_in_force_for_it,
], ids=lambda f: f.__name__.removeprefix("test_"))
def test_billing_on_postgresql(session, check):
    check(session)


def test_concurrent_rollups_and_finalizations_of_the_same_day_and_month(pg_sessions):
    """Two runs at once (a redelivered task beside the original) end with one correct set of rows."""
    import threading
    from datetime import UTC, date, datetime

    from sqlalchemy import delete, func, select

    from loraplex.platform.billing.models import Statement, UsageRollup
    from loraplex.platform.billing.rollups import rollup_day
    from loraplex.platform.billing.statements import finalize_statement
    from loraplex.platform.models import Tenant, UsageRecord

    day = date(2026, 10, 7)
    with pg_sessions() as s:
        tenant = on_sqlite._tenant(s, f"concurrent-{uuid.uuid4().hex[:6]}")
        for i in range(20):
            on_sqlite._record(s, tenant, at=datetime(2026, 10, 7, i, tzinfo=UTC), prompt=i, completion=1)
        s.commit()
        tenant_id = tenant.id
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(kind: str) -> None:
        try:
            with pg_sessions() as s:
                barrier.wait()
                if kind == "rollup":
                    rollup_day(s, day)
                else:
                    finalize_statement(s, s.get(Tenant, tenant_id), "2026-10")
                s.commit()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in ("rollup", "rollup", "final", "final")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with pg_sessions() as s:
        rows = s.scalars(select(UsageRollup).where(UsageRollup.day == day, UsageRollup.tenant_id == tenant_id)).all()
        assert sum(r.requests for r in rows) == 20 and sum(r.prompt_tokens for r in rows) == sum(range(20))
        assert s.scalar(select(func.count()).select_from(Statement).where(Statement.tenant_id == tenant_id)) == 1
        s.execute(delete(UsageRecord).where(UsageRecord.tenant_id == tenant_id))
        s.execute(delete(Tenant).where(Tenant.id == tenant_id))
        s.commit()
