"""Deletes of adapters and versions that run at the same time: each request answers for what it deleted.

A request reads the adapter, then another request's delete commits, then the first deletes: the same
version is not reported deleted twice, and two requests deleting an adapter's last two versions leave no
adapter without versions. On SQLite and on the machine's PostgreSQL.
"""

from __future__ import annotations

import uuid

import pytest
from platform_helpers import make_settings, migrated_sessions
from sqlalchemy import select

from loraplex.platform.adapter_registry import delete_adapter, delete_version
from loraplex.platform.errors import APIError
from loraplex.platform.models import Adapter, AdapterVersion, Tenant


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def sessions(request, tmp_path):
    with migrated_sessions(request.param, tmp_path, "lpx_races") as factory:
        yield factory


def _adapter_with_versions(sessions, n: int) -> tuple[int, list[int]]:
    with sessions() as s:
        tenant = Tenant(name=f"t{uuid.uuid4().hex[:8]}")
        s.add(tenant)
        s.flush()
        adapter = Adapter(tenant_id=tenant.id, name="bot")
        s.add(adapter)
        s.flush()
        versions = [AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.id, status="ready",
                                   upload_sha256=f"{i:064x}", upload_filename="a.zip", upload_bytes=1,
                                   content_hash=uuid.uuid4().hex * 2) for i in range(n)]
        s.add_all(versions)
        s.commit()
        return adapter.id, [v.id for v in versions]


def _version(session, version_id: int) -> AdapterVersion:
    version = session.get(AdapterVersion, version_id)
    assert len(version.adapter.versions) >= 1  # loaded now, before the other request's delete
    return version


def test_a_version_deleted_by_another_request_meanwhile_is_not_found(sessions, tmp_path):
    settings = make_settings(tmp_path)
    _adapter_id, (v1, _v2) = _adapter_with_versions(sessions, 2)
    with sessions() as late, sessions() as early:
        stale = _version(late, v1)
        orphaned, gone = delete_version(early, settings, _version(early, v1))
        early.commit()
        assert not gone and len(orphaned) == 1
        with pytest.raises(APIError) as err:
            delete_version(late, settings, stale)
        late.rollback()
    assert err.value.status == 404 and err.value.code == "version_not_found"


def test_two_requests_deleting_the_last_two_versions_take_the_adapter(sessions, tmp_path):
    settings = make_settings(tmp_path)
    adapter_id, (v1, v2) = _adapter_with_versions(sessions, 2)
    with sessions() as late, sessions() as early:
        stale = _version(late, v1)  # sees two versions: would keep the adapter
        _, gone = delete_version(early, settings, _version(early, v2))
        early.commit()
        assert not gone
        _, gone = delete_version(late, settings, stale)
        late.commit()
    assert gone
    with sessions() as s:
        assert s.get(Adapter, adapter_id) is None
        assert s.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter_id)).all() == []


def test_an_adapter_deleted_by_another_request_meanwhile_is_not_found(sessions, tmp_path):
    settings = make_settings(tmp_path)
    adapter_id, _ = _adapter_with_versions(sessions, 1)
    with sessions() as late, sessions() as early:
        stale = late.get(Adapter, adapter_id)
        assert len(stale.versions) == 1
        delete_adapter(early, settings, early.get(Adapter, adapter_id))
        early.commit()
        with pytest.raises(APIError) as err:
            delete_adapter(late, settings, stale)
        late.rollback()
    assert err.value.status == 404 and err.value.code == "adapter_not_found"


def test_an_adapter_delete_takes_a_version_uploaded_after_it_was_read(sessions, tmp_path):
    """The content hashes it hands back for the store include those of versions it had not loaded."""
    settings = make_settings(tmp_path)
    adapter_id, (v1,) = _adapter_with_versions(sessions, 1)
    with sessions() as late, sessions() as early:
        stale = late.get(Adapter, adapter_id)
        assert len(stale.versions) == 1
        tenant_id = early.get(Adapter, adapter_id).tenant_id
        extra = AdapterVersion(adapter_id=adapter_id, tenant_id=tenant_id, status="ready", upload_sha256="f" * 64,
                               upload_filename="b.zip", upload_bytes=1, content_hash="e" * 64)
        early.add(extra)
        early.commit()
        orphaned = delete_adapter(late, settings, stale)
        late.commit()
    assert "e" * 64 in orphaned and len(orphaned) == 2
