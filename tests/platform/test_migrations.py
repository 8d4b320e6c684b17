"""Every table has a migration: `alembic upgrade head` on an empty SQLite file, then `alembic check`."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
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


def test_version_ids_are_never_reused_and_the_rows_survive_the_change(tmp_path):
    """0106 remakes adapter_versions with AUTOINCREMENT on SQLite: rows, indexes and links to adapters kept;
    deleting the newest version no longer hands its id to the next upload."""
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'ids.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0105")
    engine = sa.create_engine(url)
    from sqlalchemy.orm import Session

    from loraplex.platform.models import Adapter, AdapterVersion, Plan, Tenant

    with Session(engine) as session:
        plan = Plan(name="p", requests_per_minute=1, tokens_per_minute=1, max_concurrent=1, monthly_token_budget=1)
        session.add(plan)
        session.flush()
        tenant = Tenant(name="t", plan_id=plan.id)
        session.add(tenant)
        session.flush()
        adapter = Adapter(tenant_id=tenant.id, name="a")
        session.add(adapter)
        session.flush()
        for vid in (1, 2, 3):
            session.add(AdapterVersion(id=vid, adapter_id=adapter.id, tenant_id=tenant.id, status="ready",
                                       upload_sha256="0" * 64, upload_filename="a.zip", upload_bytes=1,
                                       content_hash="ab" * 32, pinned=True))
        session.flush()
        session.execute(sa.delete(AdapterVersion).where(AdapterVersion.id == 3))
        session.commit()
    command.upgrade(config, "head")
    command.check(config)
    insert = sa.text("INSERT INTO adapter_versions (adapter_id, tenant_id, status, upload_sha256, upload_filename, "
                     "upload_bytes, pinned, created_at) VALUES (1, 1, 'pending', :s, 'b.zip', 1, 0, '2026-01-02')")
    with engine.begin() as conn:
        rows = conn.execute(sa.text("SELECT id, content_hash, pinned FROM adapter_versions ORDER BY id")).all()
        assert [tuple(r) for r in rows] == [(1, "ab" * 32, 1), (2, "ab" * 32, 1)]
        new_id = conn.execute(insert, {"s": "1" * 64}).lastrowid
        conn.execute(sa.text("DELETE FROM adapter_versions WHERE id = :id"), {"id": new_id})
        assert conn.execute(insert, {"s": "2" * 64}).lastrowid == new_id + 1  # not new_id again
        indexes = {i["name"] for i in sa.inspect(conn).get_indexes("adapter_versions")}
    assert "ix_adapter_versions_tenant_id_content_hash" in indexes
    command.downgrade(config, "0105")
    command.upgrade(config, "head")


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_names_differing_only_in_case_stop_the_upgrade_and_change_nothing(tmp_path, kind):
    """0107 makes tenant and plan names unique whatever their case. A database that already holds such
    names stops the upgrade with a message naming them; its rows and its version stay as they were; once
    renamed, the upgrade goes through."""
    import sqlalchemy as sa
    from platform_helpers import postgres_schema

    from loraplex.platform.db import make_engine

    context = postgres_schema("lpx_case") if kind == "postgresql" else nullcontext(f"sqlite:///{tmp_path / 'c.db'}")
    with context as url:
        config = alembic_config(url)
        command.upgrade(config, "0106")
        engine = make_engine(url, pooled=False)
        with engine.begin() as conn:
            for name in ("acme", "ACME", "other"):
                conn.execute(sa.text("INSERT INTO tenants (name, status, created_at) VALUES (:n, 'active', "
                                     "CURRENT_TIMESTAMP)"), {"n": name})
        with pytest.raises(Exception, match="differ only in case") as info:
            command.upgrade(config, "head")
        assert "'acme' (id 1), 'ACME' (id 2)" in str(info.value) and "other" not in str(info.value)
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0106"
            assert conn.execute(sa.text("SELECT count(*) FROM tenants")).scalar() == 3
            conn.execute(sa.text("UPDATE tenants SET name = 'acme-2' WHERE id = 2"))
        command.upgrade(config, "head")
        with engine.begin() as conn, pytest.raises(sa.exc.IntegrityError):
            conn.execute(sa.text("INSERT INTO tenants (name, status, created_at) VALUES ('Other', 'active', "
                                 "CURRENT_TIMESTAMP)"))
        engine.dispose()
