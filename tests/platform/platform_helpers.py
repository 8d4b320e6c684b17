"""Helpers shared by the control-plane tests (a uniquely named module, importable from any test)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loraplex.config import Settings

TEST_SECRET = "test-secret-0123456789abcdef"
PG_URL = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def postgres_schema(prefix: str) -> Iterator[str]:
    """A fresh schema on the machine's PostgreSQL, dropped afterwards; yields a URL that works in it."""
    import psycopg2
    import pytest

    try:
        conn = psycopg2.connect(PG_URL, connect_timeout=3)
    except Exception as exc:
        pytest.fail(f"integration tests need PostgreSQL at {PG_URL}: {exc}")
    conn.autocommit = True
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    conn.cursor().execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        conn.cursor().execute(f"DROP SCHEMA {schema} CASCADE")
        conn.close()


@contextmanager
def migrated_sessions(kind: str, tmp_path: Path, prefix: str):
    """A session factory on a database migrated to head: a SQLite file under tmp_path ("sqlite") or a fresh
    schema on the machine's PostgreSQL ("postgresql")."""
    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.migrate import upgrade_to_head

    with (postgres_schema(prefix) if kind == "postgresql" else _sqlite_url(tmp_path / f"{prefix}.db")) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            yield make_session_factory(engine)
        finally:
            engine.dispose()


@contextmanager
def _sqlite_url(path: Path) -> Iterator[str]:
    yield f"sqlite:///{path}"


def make_settings(data_dir: Path, **overrides) -> Settings:
    values = dict(environment="test", secret_key=TEST_SECRET, data_dir=data_dir, warm_adapters_interval=0,
                  database_url=f"sqlite:///{data_dir / 'loraplex.db'}", auto_migrate=False,
                  embedded_engine=False, redis_url=None, usage_flush_interval=0.05)
    values.update(overrides)
    return Settings(**values)


@dataclass
class TenantKey:
    tenant_id: int
    tenant_name: str
    key_id: int
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def upload(client, tenant: TenantKey, name: str, files: list[tuple[str, bytes]], *, wait: bool = True):
    """POST /v1/adapters with the given (filename, content) pairs."""
    return client.post("/v1/adapters", params={"wait": str(wait).lower()}, headers=tenant.headers,
                       data={"name": name}, files=[("file", (fn, content)) for fn, content in files])


def admin_cli(code: int = 0):
    """run(*args, code=0): `loraplex admin ARGS` through click's runner; asserts the exit code and that no
    traceback reached the user, and returns the output."""
    from click.testing import CliRunner

    from loraplex.platform.commands import admin

    runner = CliRunner()

    def run(*args, code=code):
        r = runner.invoke(admin, list(args))
        assert r.exit_code == code, r.output
        assert "Traceback" not in r.output
        return r.output

    return run
