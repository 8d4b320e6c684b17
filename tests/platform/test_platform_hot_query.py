"""HotQuery: the per-request lookups run on the DBAPI connection give what a Core execute gives, and never
serve a stale answer."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import DateTime, bindparam, select

from loraplex.platform.auth import _TENANT_BY_KEY, authenticate_tenant_fast
from loraplex.platform.db import make_engine, make_session_factory, session_scope
from loraplex.platform.errors import APIError
from loraplex.platform.hot_query import HotQuery
from loraplex.platform.models import ApiKey, Tenant
from loraplex.platform.schemas.tenants import KeyCreate, TenantCreate
from loraplex.platform.security import hash_key
from loraplex.platform.tenants import create_api_key, create_tenant, revoke_api_key


@pytest.fixture
def db(settings):
    engine = make_engine(settings.resolved_database_url)
    yield engine
    engine.dispose()


def _new_key(db, settings, name="hq"):
    with session_scope(make_session_factory(db)) as session:
        tenant = create_tenant(session, TenantCreate(name=name))
        return tenant.id, create_api_key(session, settings, tenant, KeyCreate()).key


def test_same_row_as_core_execute_with_result_types_applied(db, settings):
    _, key = _new_key(db, settings)
    with session_scope(make_session_factory(db)) as session:
        revoke_api_key(session, session.scalar(select(ApiKey)))
    key_hash = hash_key(settings.secret_key, key)
    with db.connect() as conn:
        expected = tuple(conn.execute(_TENANT_BY_KEY.stmt, {"key_hash": key_hash}).first())
    got = _TENANT_BY_KEY.first(db, key_hash=key_hash)
    assert got == expected
    revoked_at = got[3]
    assert isinstance(revoked_at, datetime) and revoked_at.tzinfo is not None  # SQLite gave text
    assert _TENANT_BY_KEY.first(db, key_hash="0" * 64) is None


def test_statement_literals_and_limit_are_bound(db, settings):
    tenant_id, _ = _new_key(db, settings)
    _new_key(db, settings, name="hq2")
    newest = HotQuery(select(Tenant.id, Tenant.name).where(Tenant.id >= bindparam("low"))
                      .order_by(Tenant.id.desc()).limit(1))
    row = newest.first(db, low=tenant_id)
    assert row is not None and row[0] > tenant_id and row[1] == "hq2"
    assert newest.first(db, low=10**6) is None


def test_a_revoked_key_fails_on_its_very_next_request(db, settings):
    _, key = _new_key(db, settings)
    assert authenticate_tenant_fast(db, settings, key).tenant_name == "hq"
    with session_scope(make_session_factory(db)) as session:
        revoke_api_key(session, session.scalar(select(ApiKey)))
    with pytest.raises(APIError) as info:
        authenticate_tenant_fast(db, settings, key)
    assert info.value.status == 401 and "revoked" in str(info.value.message)


def test_refuses_binds_that_need_type_processing(db):
    query = HotQuery(select(Tenant.id).where(Tenant.created_at > bindparam("t", type_=DateTime(timezone=True))))
    with pytest.raises(ValueError, match="type processing"):
        query.first(db, t=datetime.now(UTC))


def test_a_database_that_does_not_answer_is_sqlalchemys_error_not_the_drivers(db, settings, monkeypatch):
    """The per-request key lookup runs on the DBAPI connection: a database away (no connection to be had, or one
    dropped under a query) must still raise SQLAlchemy's OperationalError, which the API answers with a 503,
    not the driver's own error (a 500 and a traceback per request)."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    _, key = _new_key(db, settings)
    key_hash = hash_key(settings.secret_key, key)

    def unreachable():
        raise sqlite3.OperationalError("unable to open database file")

    with monkeypatch.context() as patch:
        patch.setattr(db, "raw_connection", unreachable)
        with pytest.raises(OperationalError) as info:
            _TENANT_BY_KEY.first(db, key_hash=key_hash)
    assert isinstance(info.value.orig, sqlite3.OperationalError)

    class DroppedCursor:
        def execute(self, *args):
            raise sqlite3.OperationalError("disk I/O error")

        def close(self):
            pass

    conn = db.raw_connection()
    monkeypatch.setattr(type(conn), "cursor", lambda self: DroppedCursor())
    monkeypatch.setattr(db, "raw_connection", lambda: conn)
    with pytest.raises(OperationalError):
        _TENANT_BY_KEY.first(db, key_hash=key_hash)


def test_a_database_outage_on_the_key_lookup_is_a_503(client, app, make_tenant, monkeypatch, caplog):
    import logging
    import sqlite3

    tenant = make_tenant()
    services = app.state.services

    def unreachable():
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(services.db, "raw_connection", unreachable)
    with caplog.at_level(logging.WARNING):
        r = client.get("/v1/models", headers=tenant.headers)
    assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
    assert r.json()["error"]["code"] == "service_unavailable"
    lines = [rec for rec in caplog.records if "did not answer" in rec.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None, [rec.getMessage() for rec in caplog.records]
    assert "the database did not answer" in lines[0].getMessage()
