"""Two first uploads of one adapter name race to create it; the loser retries and finds the adapter.
The console's upload shares that registration with the API (it used to have its own copy without it)."""

from __future__ import annotations

import threading
import uuid

import pytest
from console_helpers import Console
from platform_helpers import upload
from sqlalchemy.exc import IntegrityError

import loraplex.platform.routes.adapters as adapter_routes


@pytest.fixture
def console(app, client, admin_key) -> Console:
    c = Console(client=client, app=app, admin_key=admin_key)
    c.sign_in()
    return c


@pytest.fixture
def lose_one_race(monkeypatch):
    """The first registration fails as if another process had just inserted the same adapter name."""
    real = adapter_routes.register_upload
    calls = []

    def racing(session, scope, settings, parsed, *rest):
        calls.append(parsed)
        if len(calls) == 1:
            raise IntegrityError("INSERT INTO adapters", {}, Exception("UNIQUE constraint failed"))
        return real(session, scope, settings, parsed, *rest)

    monkeypatch.setattr(adapter_routes, "register_upload", racing)
    return calls


def test_api_upload_survives_the_race(client, make_tenant, peft_adapter_zip, lose_one_race):
    tenant = make_tenant()
    r = upload(client, tenant, "raced", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    assert len(lose_one_race) == 2


def test_console_upload_survives_the_race(console, make_tenant, peft_adapter_zip, lose_one_race):
    tenant = make_tenant("racer")
    r = console.client.post(f"/console/api/tenants/{tenant.tenant_id}/adapters", data={"name": "raced"},
                            files={"file": ("adapter.zip", peft_adapter_zip.read_bytes(), "application/zip")},
                            headers={"X-CSRF-Token": console.csrf})
    assert r.status_code == 202, r.text
    assert r.json()["name"] == "raced" and len(lose_one_race) == 2


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def sessions(request, tmp_path):
    from platform_helpers import migrated_sessions

    with migrated_sessions(request.param, tmp_path, "lpx_uploads") as factory:
        yield factory


def _parsed(tmp_path, name: str, sha: str):
    from loraplex.platform.uploads import ParsedUpload, UploadedFile

    folder = tmp_path / f"incoming-{uuid.uuid4().hex}"
    folder.mkdir()
    (folder / "a.zip").write_bytes(b"zip")
    return ParsedUpload(folder, {"name": name}, [UploadedFile("file", "a.zip", folder / "a.zip", 3, sha)])


def test_the_same_files_uploaded_at_the_same_time_make_one_version(sessions, tmp_path):
    """Upload B reads the adapter's newest version while upload A of the same files has made its version but
    not committed it: B must wait for A and answer with A's version, as an upload after A does."""
    from platform_helpers import make_settings
    from sqlalchemy import event, select

    from loraplex.platform.adapter_registry import register_upload
    from loraplex.platform.models import Adapter, AdapterVersion, Tenant
    from loraplex.platform.scoping import TenantScope

    settings = make_settings(tmp_path)
    with sessions() as s:
        tenant = Tenant(name=f"t{uuid.uuid4().hex[:8]}")
        s.add(tenant)
        s.commit()
        tenant_id = tenant.id
    # the adapter exists already (with another version): both uploads find it
    with sessions() as s:
        register_upload(s, TenantScope(s, tenant_id), settings, _parsed(tmp_path, "race", "1" * 64))
        s.commit()
    engine = sessions.kw["bind"]
    b_thread: list[int] = []
    b_at_the_race = threading.Event()

    def lock_or_read(when):
        def hook(_conn, _cursor, statement, *_args):
            if threading.get_ident() not in b_thread:
                return
            text = " ".join(statement.split()).upper()
            if when == "before" and text.startswith("UPDATE ADAPTERS"):
                b_at_the_race.set()  # about to wait for A's lock
            if when == "after" and "FROM ADAPTER_VERSIONS" in text and "ORDER BY" in text:
                b_at_the_race.set()  # read the newest version without waiting for A
        return hook

    before, after = lock_or_read("before"), lock_or_read("after")
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    answers = {}

    def upload_b():
        b_thread.append(threading.get_ident())
        with sessions() as s:
            version, created = register_upload(s, TenantScope(s, tenant_id), settings,
                                               _parsed(tmp_path, "race", "2" * 64))
            s.commit()
            answers["b"] = (version.id, created)

    try:
        with sessions() as a:
            version_a, created_a = register_upload(a, TenantScope(a, tenant_id), settings,
                                                   _parsed(tmp_path, "race", "2" * 64))
            b = threading.Thread(target=upload_b)
            b.start()
            b_at_the_race.wait()
            a.commit()
            answers["a"] = (version_a.id, created_a)
        b.join()
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    assert answers["a"][1] is True and answers["b"] == (answers["a"][0], False)
    with sessions() as s:
        shas = s.scalars(select(AdapterVersion.upload_sha256).join(Adapter).where(
            Adapter.tenant_id == tenant_id, Adapter.name == "race").order_by(AdapterVersion.id)).all()
    assert shas == ["1" * 64, "2" * 64]
