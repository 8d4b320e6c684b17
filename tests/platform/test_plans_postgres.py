"""The admin API's plan and plan-history checks again on the machine's PostgreSQL (its own schema, migrated
with Alembic): renames, quota edits reaching tenants, deletes refused while tenants are or were on a plan,
and currency guards over scheduled price changes."""

from __future__ import annotations

import pytest
from platform_helpers import make_settings, postgres_schema

# Collected here again, with this module's `settings` (PostgreSQL) in place of the SQLite one.
from test_admin_api import (  # noqa: F401
    test_a_plan_edit_is_strict_and_names_stay_unique,
    test_a_plan_edit_reaches_its_tenants_next_request_unless_they_override,
    test_a_plan_is_deleted_only_when_no_tenant_is_on_it_nor_its_history_names_it,
    test_a_plan_joined_and_left_within_one_month_prices_nothing_and_may_be_deleted,
    test_create_tenant_plan_and_key,
    test_tenant_and_plan_names_are_unique_whatever_their_case,
)
from test_plan_history import (  # noqa: F401
    test_a_currency_change_already_scheduled_is_no_way_around_the_override_check,
    test_a_plan_change_applies_from_its_month_on,
    test_an_override_is_never_carried_into_another_currency,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(data_dir, tiny_llama_dir):
    from loraplex.platform.migrate import upgrade_to_head

    with postgres_schema("lpx_plans") as url:
        upgrade_to_head(url)
        yield make_settings(data_dir, model=str(tiny_llama_dir), database_url=url)


def test_these_checks_run_on_postgresql(app, client):
    with app.state.services.sessions() as session:
        assert session.get_bind().dialect.name == "postgresql"
