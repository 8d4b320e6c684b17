"""Run Alembic migrations from code: `loraplex serve` creates or upgrades its database on start."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from loraplex.resources import resource_dir

MIGRATIONS_DIR = resource_dir("migrations")


def alembic_config(url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise RuntimeError(f"migrations not found at {MIGRATIONS_DIR}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_to_head(url: str) -> None:
    command.upgrade(alembic_config(url), "head")
