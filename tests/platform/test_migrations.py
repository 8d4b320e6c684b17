"""Every table has a migration: `alembic upgrade head` on an empty SQLite file, then `alembic check`."""

from __future__ import annotations

from alembic import command
from alembic.script import ScriptDirectory

from loraplex.platform.migrate import alembic_config


def test_upgrade_empty_sqlite_and_check(tmp_path):
    config = alembic_config(f"sqlite:///{tmp_path / 'fresh.db'}")
    command.upgrade(config, "head")
    command.check(config)  # raises when models and migrations differ


def test_single_head():
    heads = ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()
    assert len(heads) == 1, heads
