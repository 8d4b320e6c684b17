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

    # a pinned version is pinned again on every run (an engine that restarted holds no pins of its own)
    from loraplex.platform.models import AdapterVersion

    with services.sessions() as session:
        session.get(AdapterVersion, a["id"]).pinned = True
        session.commit()
    fake_engine.prefetched.clear()
    services.tasks.send("loraplex.warm_popular_adapters")
    services.tasks.join()
    services.tasks.join()
    assert fake_engine.prefetched == [(a["content_hash"], True), (b["content_hash"], None)]


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
