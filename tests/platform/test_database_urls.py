"""Database and Redis URLs: the forms users write reach the driver loraplex installs (psycopg2), URLs of other
kinds are refused by setting name, and passwords never reach a message."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from loraplex.cli import main
from loraplex.config import Settings, masked_url
from loraplex.platform.db import normalize_url


@pytest.mark.parametrize("url", [
    "postgresql://u@h:5432/db", "postgres://u@h:5432/db", "postgresql+psycopg://u@h:5432/db",
])
def test_postgres_urls_use_the_installed_driver(monkeypatch, url):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a))
    assert normalize_url(url) == "postgresql+psycopg2://u@h:5432/db"


def test_psycopg3_urls_are_kept_where_it_is_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert normalize_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql://u@h/db") == "postgresql://u@h/db"


@pytest.mark.parametrize("url", ["sqlite:///x.db", "postgresql+psycopg2://u@h/db", "mysql+pymysql://u@h/db"])
def test_other_urls_are_left_alone(url):
    assert normalize_url(url) == url


@pytest.mark.parametrize(("field", "value"), [
    ("database_url", "garbage://x"), ("database_url", "mysql://u@h/db"), ("database_url", "/var/db.sqlite"),
    ("redis_url", "localhost:6379"), ("redis_url", "http://h:6379"),
])
def test_urls_of_unknown_kinds_are_refused(tmp_path, field, value):
    with pytest.raises(ValidationError, match="must be a"):
        Settings(data_dir=tmp_path, **{field: value})


@pytest.mark.parametrize("value", ["sqlite:////tmp/x.db", "sqlite+pysqlite:///x.db", "postgres://u@h/db",
                                   "postgresql+psycopg2://u:p@h:5432/db", "POSTGRESQL://u@h/db"])
def test_database_urls_loraplex_serves_are_taken(tmp_path, value):
    assert Settings(data_dir=tmp_path, database_url=value).database_url == value


def test_an_empty_url_means_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", " ")
    s = Settings(data_dir=tmp_path)
    assert s.database_url is None and s.redis_url is None and s.resolved_database_url.startswith("sqlite:///")


def test_passwords_never_reach_messages(tmp_path):
    assert masked_url("postgresql://u:s3cret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert masked_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert masked_url("postgresql://u@h/db") == "postgresql://u@h/db"
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_DATABASE_URL": "mysql://u:s3cret@h/db"}
    r = CliRunner().invoke(main, ["admin", "list-tenants"], env=env)
    assert r.exit_code == 1 and "database_url (LORAPLEX_DATABASE_URL): must be a SQLite" in r.output
    assert "s3cret" not in r.output and "Traceback" not in r.output
    env["LORAPLEX_DATABASE_URL"] = "postgresql://u:s3cret@127.0.0.1:1/db"
    r = CliRunner().invoke(main, ["admin", "list-tenants"], env=env)
    assert r.exit_code == 1 and "cannot reach the database postgresql://u:***@127.0.0.1:1/db" in r.output
    assert "s3cret" not in r.output
