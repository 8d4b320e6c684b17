"""API replicas starting together on a new database: exactly one of them creates (and prints) the admin key."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from platform_helpers import postgres_schema
from sqlalchemy import func, select

from loraplex.config import Settings
from loraplex.platform import bootstrap
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.models import AdminKey


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_concurrent_first_starts_create_one_admin_key(kind, tmp_path, monkeypatch):
    if kind == "postgresql":
        with postgres_schema("lpx_first_start") as url:
            _race(Settings(data_dir=tmp_path, database_url=url, environment="test"), monkeypatch)
    else:
        _race(Settings(data_dir=tmp_path, environment="test"), monkeypatch)


def _race(settings: Settings, monkeypatch) -> None:
    bootstrap.prepare_database(settings)
    # Each process that gets to the insert waits there for the other: two processes that both passed the
    # "no admin key yet" check meet here and both insert. Under the lock the second waits before its check,
    # so the first's wait times out, it inserts and commits, and the second then finds the key.
    both_checked = threading.Barrier(2, timeout=3)
    create_admin_key = bootstrap.create_admin_key

    def create_after_the_other_checked(session, settings):
        try:
            both_checked.wait()
        except threading.BrokenBarrierError:
            pass
        return create_admin_key(session, settings)

    monkeypatch.setattr(bootstrap, "create_admin_key", create_after_the_other_checked)
    with ThreadPoolExecutor(2) as pool:
        secrets = list(pool.map(lambda _: bootstrap.ensure_admin_key(settings), range(2)))

    assert sum(secret is not None for secret in secrets) == 1, secrets
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with make_session_factory(engine)() as session:
            assert session.scalar(select(func.count()).select_from(AdminKey)) == 1
    finally:
        engine.dispose()
