"""The billing migrations: one head, and prices survive the move to per-period price lists and back."""

from __future__ import annotations

import sqlite3

from alembic import command
from alembic.script import ScriptDirectory

from loraplex.platform.migrate import alembic_config


def test_the_migration_history_has_exactly_one_head(tmp_path):
    script = ScriptDirectory.from_config(alembic_config(f"sqlite:///{tmp_path / 'x.db'}"))
    assert len(script.get_heads()) == 1, script.get_heads()


def test_prices_carry_over_to_periods_and_back(tmp_path):
    path = tmp_path / "prices.db"
    config = alembic_config(f"sqlite:///{path}")
    command.upgrade(config, "0101")
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO tenants (id, name, status, created_at) VALUES (1, 'acme', 'active', '2026-11-01')")
        db.execute("INSERT INTO plan_prices (plan_id, currency, prompt_price, completion_price, "
                   "adapter_surcharge_price, updated_at) VALUES (NULL, 'EUR', 5, 6, 7, '2026-11-01')")
        db.execute("INSERT INTO tenant_price_overrides VALUES (1, 9, NULL, NULL, '2026-11-01')")
    command.upgrade(config, "0102")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT plan_id, effective_period, currency, prompt_price FROM plan_prices").fetchall() \
            == [(None, "2000-01", "EUR", 5)]
        assert db.execute("SELECT tenant_id, effective_period, prompt_price, completion_price FROM tenant_prices"
                          ).fetchall() == [(1, "2000-01", 9, None)]
        db.execute("INSERT INTO tenant_prices (tenant_id, effective_period, prompt_price, updated_at) "
                   "VALUES (1, '2026-12', 11, '2026-11-02')")
    command.downgrade(config, "0101")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT tenant_id, prompt_price FROM tenant_price_overrides").fetchall() == [(1, 11)]
        assert db.execute("SELECT currency, prompt_price FROM plan_prices").fetchall() == [("EUR", 5)]


def test_every_tenant_starts_its_plan_history_on_its_current_plan(tmp_path):
    path = tmp_path / "plans.db"
    config = alembic_config(f"sqlite:///{path}")
    command.upgrade(config, "0103")
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO plans VALUES (3, 'pro', 10, 1000, 4, 100000, '2026-11-01')")
        db.execute("INSERT INTO tenants (id, name, status, plan_id, created_at) "
                   "VALUES (1, 'acme', 'active', 3, '2026-11-01'), (2, 'globex', 'active', NULL, '2026-11-01')")
    command.upgrade(config, "head")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT tenant_id, effective_period, plan_id FROM tenant_plans ORDER BY tenant_id"
                          ).fetchall() == [(1, "2000-01", 3), (2, "2000-01", None)]
    command.downgrade(config, "0103")
