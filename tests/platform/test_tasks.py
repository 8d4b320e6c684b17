"""Celery task bodies: idempotent validation, and keeping the busiest adapters of the last hour warm."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from platform_helpers import upload

from loraplex.platform.models import UsageRecord
from loraplex.platform.tasks import jobs
from loraplex.platform.tasks.context import get_context


def _usage(session, tenant_id: int, content_hash: str | None, n: int, age: timedelta = timedelta(minutes=5)):
    for _ in range(n):
        _usage.counter += 1
        session.add(UsageRecord(request_id=f"req_t{_usage.counter}", tenant_id=tenant_id, api_key_id=None,
                                model="m", adapter_name="a", adapter_version=content_hash, endpoint="completions",
                                prompt_tokens=1, completion_tokens=1, latency_ms=1, status="ok",
                                created_at=datetime.now(UTC) - age))


_usage.counter = 0


def test_busiest_adapters_of_the_last_hour_are_warmed(app, client, make_tenant, fake_engine, peft_adapter_dir,
                                                      peft_adapter_zip):
    tenant = make_tenant()
    a = upload(client, tenant, "a", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    files = [(n, (peft_adapter_dir / n).read_bytes()) for n in ("adapter_config.json", "adapter_model.safetensors")]
    import json

    config = json.loads(dict(files)["adapter_config.json"])
    config["lora_alpha"] = 3  # other weights after folding alpha/r: another version
    files = [(n, json.dumps(config).encode() if n == "adapter_config.json" else c) for n, c in files]
    b = upload(client, tenant, "b", files).json()
    assert b.get("status") == "ready", b
    assert a["content_hash"] != b["content_hash"]
    services = app.state.services
    services.tasks.join()
    fake_engine.prefetched.clear()
    with services.sessions() as session:
        _usage(session, tenant.tenant_id, b["content_hash"], 3)
        _usage(session, tenant.tenant_id, a["content_hash"], 1)
        _usage(session, tenant.tenant_id, a["content_hash"], 9, age=timedelta(hours=2))  # too old to count
        _usage(session, tenant.tenant_id, None, 20)  # base model traffic
        session.commit()

    assert jobs.busiest_versions(get_context()) == [b["id"], a["id"]]
    services.tasks.send("loraplex.warm_popular_adapters")
    services.tasks.join()
    services.tasks.join()  # the prefetches it sent
    assert [h for h, _ in fake_engine.prefetched] == [b["content_hash"], a["content_hash"]]

    # a pinned version is left to the engines' own pin sync (a task on the shared engine queue would pin it
    # on one engine only)
    from loraplex.platform.models import AdapterVersion

    with services.sessions() as session:
        session.get(AdapterVersion, a["id"]).pinned = True
        session.commit()
    fake_engine.prefetched.clear()
    services.tasks.send("loraplex.warm_popular_adapters")
    services.tasks.join()
    services.tasks.join()
    assert fake_engine.prefetched == [(b["content_hash"], None)]


def test_an_engine_takes_its_pins_from_the_database(app, client, make_tenant, fake_engine, peft_adapter_zip):
    """An engine that restarted holds no pins, and one an unpin did not reach (away, or pinned through
    another engine process) holds a stale one: the sync pins what the database pins and undoes the rest."""
    from loraplex.platform.models import AdapterVersion

    tenant = make_tenant()
    a = upload(client, tenant, "a", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    services = app.state.services
    services.tasks.join()
    with services.sessions() as session:
        session.get(AdapterVersion, a["id"]).pinned = True
        session.commit()
    stale = "ef" * 32
    fake_engine.pinned = {stale}
    fake_engine.prefetched.clear()
    ctx = get_context()
    assert jobs.sync_pins(ctx) == (1, 1)
    assert fake_engine.pinned == {a["content_hash"]} and fake_engine.unpinned == [stale]
    assert fake_engine.prefetched == [(a["content_hash"], True)]
    assert jobs.sync_pins(ctx) == (0, 0)  # nothing to change: no reload of what is pinned already
    assert fake_engine.prefetched == [(a["content_hash"], True)]

    # unpinned in the database while this engine was away: the next sync lets it go
    with services.sessions() as session:
        session.get(AdapterVersion, a["id"]).pinned = False
        session.commit()
    assert jobs.sync_pins(ctx) == (0, 1)
    assert fake_engine.pinned == set()


def _pinned_upload(app, client, make_tenant, peft_adapter_zip) -> dict:
    from loraplex.platform.models import AdapterVersion

    version = upload(client, make_tenant(), "a", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    app.state.services.tasks.join()
    with app.state.services.sessions() as session:
        session.get(AdapterVersion, version["id"]).pinned = True
        session.commit()
    return version


def _wait_for(condition) -> None:
    import time

    deadline = time.monotonic() + 60  # a hang guard, not a speed check
    while not condition():
        assert time.monotonic() < deadline, "the pin sync did not run"
        time.sleep(0.01)


def test_an_embedded_engine_gets_its_pins_when_the_app_starts(app, client, make_tenant, peft_adapter_zip,
                                                               settings, monkeypatch):
    """`loraplex serve` restarted: its new engine holds the database's pins without waiting for a warm-up."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    import loraplex.platform.engine_factory as factory
    from loraplex.platform.app import create_app

    version = _pinned_upload(app, client, make_tenant, peft_adapter_zip)
    restarted = FakeEngine()
    monkeypatch.setattr(factory, "build_engine", lambda _settings: restarted)
    with TestClient(create_app(settings.model_copy(update={"embedded_engine": True}))):
        _wait_for(lambda: restarted.pinned)
    assert restarted.prefetched == [(version["content_hash"], True)]


def test_an_engine_process_gets_its_pins_when_it_starts(app, client, make_tenant, peft_adapter_zip, settings):
    """`loraplex engine` restarted (several may serve one API): each takes the pins from the database."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from loraplex.platform.remote.server import build_engine_app

    version = _pinned_upload(app, client, make_tenant, peft_adapter_zip)
    restarted = FakeEngine()
    with TestClient(build_engine_app(settings, restarted, advertise="http://127.0.0.1:1")):
        _wait_for(lambda: restarted.pinned)
    assert restarted.prefetched == [(version["content_hash"], True)]


def test_validation_is_idempotent(app, client, make_tenant, peft_adapter_zip):
    tenant = make_tenant()
    version = upload(client, tenant, "a", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    ctx = get_context()
    assert jobs.validate_adapter(ctx, version["id"]) == "ready"  # a redelivery finds the work done
    detail = client.get("/v1/adapters/a", headers=tenant.headers).json()
    assert detail["versions"][0]["ready_at"] == version["ready_at"]
    client.delete("/v1/adapters/a", headers=tenant.headers)
    assert jobs.validate_adapter(ctx, version["id"]) == "missing"


def test_startup_resumes_unfinished_validations_and_clears_stale_staging(app, client, make_tenant,
                                                                          peft_adapter_zip):
    import os
    import time

    from loraplex.platform.adapter_registry import uploads_root, version_upload_dir
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Adapter, AdapterVersion
    from loraplex.platform.recovery import remove_stale_staging, resume_validations

    services = app.state.services
    tenant = make_tenant()
    with session_scope(services.sessions) as session:  # a process died while validating this upload
        adapter = Adapter(tenant_id=tenant.tenant_id, name="interrupted")
        session.add(adapter)
        session.flush()
        version = AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.tenant_id, status="validating",
                                 upload_sha256="0" * 64, upload_filename="a.zip",
                                 upload_bytes=peft_adapter_zip.stat().st_size)
        session.add(version)
        session.flush()
        version_id = version.id
    folder = version_upload_dir(services.settings, version_id)
    folder.mkdir(parents=True)
    (folder / "a.zip").write_bytes(peft_adapter_zip.read_bytes())
    stale = uploads_root(services.settings) / "incoming-dead"
    fresh = uploads_root(services.settings) / "incoming-live"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    assert remove_stale_staging(services) == 1 and not stale.exists() and fresh.exists()
    assert resume_validations(services) == 1
    services.tasks.join()
    detail = client.get("/v1/adapters/interrupted", headers=tenant.headers).json()
    assert detail["status"] == "ready"


def test_a_pin_that_cannot_be_loaded_is_reported_once_and_retried(app, client, make_tenant, fake_engine,
                                                                   peft_adapter_zip, caplog):
    import logging

    version = _pinned_upload(app, client, make_tenant, peft_adapter_zip)

    async def broken(adapter, *, pin=None):
        raise OSError("store entry unreadable")

    fake_engine.prefetch_adapter = broken
    ctx = get_context()
    with caplog.at_level(logging.DEBUG, logger=jobs.log.name):
        assert jobs.sync_pins(ctx) == (0, 0)
        assert jobs.sync_pins(ctx) == (0, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and version["content_hash"][:12] in warnings[0] and "unreadable" in warnings[0]
    del fake_engine.prefetch_adapter  # readable again: the next run pins it
    assert jobs.sync_pins(ctx) == (1, 0) and fake_engine.pinned == {version["content_hash"]}


def test_a_queued_pin_applies_the_databases_pin_not_the_one_it_carried(app, client, make_tenant, fake_engine,
                                                                         peft_adapter_zip):
    """A pin task queued while no engine ran, and an unpin made since: the engine gets the unpin."""
    from loraplex.platform.models import AdapterVersion

    version = _pinned_upload(app, client, make_tenant, peft_adapter_zip)
    ctx = get_context()
    assert jobs.prefetch_adapter(ctx, version["id"], pin=False)  # stale: the database pins it
    assert fake_engine.prefetched[-1] == (version["content_hash"], True)
    with app.state.services.sessions() as session:
        session.get(AdapterVersion, version["id"]).pinned = False
        session.commit()
    assert jobs.prefetch_adapter(ctx, version["id"], pin=True)  # stale: unpinned since
    assert fake_engine.prefetched[-1] == (version["content_hash"], False)
    assert jobs.prefetch_adapter(ctx, version["id"])  # a plain warm-up leaves the pin alone
    assert fake_engine.prefetched[-1] == (version["content_hash"], None)


def test_a_validation_that_cannot_find_the_staged_upload_is_a_server_problem(app, client, make_tenant,
                                                                             peft_adapter_zip, monkeypatch,
                                                                             caplog):
    import logging
    import shutil

    from loraplex.platform.adapter_registry import version_upload_dir

    tenant = make_tenant()

    async def lost(*args, **kwargs):  # queued for a worker that has not run yet
        return None

    monkeypatch.setattr(app.state.services.tasks, "send_async", lost)
    version_id = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())], wait=False).json()["id"]
    staged = version_upload_dir(app.state.services.settings, version_id)
    shutil.rmtree(staged)  # what a worker with another LORAPLEX_DATA_DIR sees
    with caplog.at_level(logging.ERROR, logger="loraplex.platform.tasks.jobs"):
        assert jobs.validate_adapter(get_context(), version_id) == "failed"
    assert str(staged) in caplog.text and "LORAPLEX_DATA_DIR" in caplog.text
    failed = client.get("/v1/adapters/bot", headers=tenant.headers).json()["versions"][0]
    assert failed["status"] == "failed" and failed["error_code"] == "upload_unavailable"
    assert "a server problem" in failed["error"] and "/" not in failed["error"]
    r = client.post("/v1/completions", headers=tenant.headers, json={"model": "bot", "prompt": "hi"})
    assert "upload_unavailable" in r.json()["error"]["message"] and "corrected" not in r.json()["error"]["message"]


def test_startup_removes_the_staged_uploads_of_finished_or_deleted_versions(app, client, make_tenant):
    import os
    import time

    from loraplex.platform.adapter_registry import version_upload_dir
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Adapter, AdapterVersion
    from loraplex.platform.recovery import remove_stale_staging

    services = app.state.services
    tenant = make_tenant()
    ids = {}
    with session_scope(services.sessions) as session:
        adapter = Adapter(tenant_id=tenant.tenant_id, name="left")
        session.add(adapter)
        session.flush()
        for status in ("pending", "validating", "ready", "failed"):
            version = AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.tenant_id, status=status,
                                     upload_sha256=status[0] * 64, upload_filename="a.zip", upload_bytes=1)
            session.add(version)
            session.flush()
            ids[status] = version.id
    ids["deleted"], ids["registering"] = 10_000, 10_001  # no row: deleted long ago, or not committed yet
    for version_id in ids.values():
        version_upload_dir(services.settings, version_id).mkdir(parents=True)
    old = time.time() - 7200
    os.utime(version_upload_dir(services.settings, ids["deleted"]), (old, old))

    assert remove_stale_staging(services) == 3
    left = {status for status, version_id in ids.items() if version_upload_dir(services.settings, version_id).exists()}
    assert left == {"pending", "validating", "registering"}
