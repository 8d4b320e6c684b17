"""The billing checks again on the machine's PostgreSQL (its own schema, migrated with Alembic)."""

from __future__ import annotations

import os
import uuid

import pytest
import test_billing_statements as on_sqlite

pytestmark = pytest.mark.integration

PG_URL = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module")
def pg_sessions():
    import psycopg2

    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.migrate import upgrade_to_head

    try:
        conn = psycopg2.connect(PG_URL, connect_timeout=3)
    except Exception as exc:
        pytest.fail(f"integration tests need PostgreSQL at {PG_URL}: {exc}")
    conn.autocommit = True
    schema = f"lpx_bill_{uuid.uuid4().hex[:10]}"
    conn.cursor().execute(f"CREATE SCHEMA {schema}")
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    try:
        upgrade_to_head(url)
        engine = make_engine(url)
        yield make_session_factory(engine)
        engine.dispose()
    finally:
        conn.cursor().execute(f"DROP SCHEMA {schema} CASCADE")
        conn.close()


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
