"""Paging and search again on the machine's PostgreSQL (its own schema, migrated with Alembic): the cursor
comparisons and the escaped ILIKE-style match agree with SQLite's."""

from __future__ import annotations

import pytest
from platform_helpers import make_settings, postgres_schema

# Collected here again, with this module's `settings` (PostgreSQL) in place of the SQLite one.
from test_paging import (  # noqa: F401
    test_admin_tenants_walk_every_page_without_gaps_or_repeats,
    test_keys_search_by_name_or_prefix_and_page,
    test_search_is_case_insensitive_and_takes_like_wildcards_literally,
    test_tenant_adapters_walk_every_page_and_search,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(data_dir, tiny_llama_dir):
    from loraplex.platform.migrate import upgrade_to_head

    with postgres_schema("lpx_paging") as url:
        upgrade_to_head(url)
        yield make_settings(data_dir, model=str(tiny_llama_dir), database_url=url)


def test_these_checks_run_on_postgresql(app, client):
    with app.state.services.sessions() as session:
        assert session.get_bind().dialect.name == "postgresql"
