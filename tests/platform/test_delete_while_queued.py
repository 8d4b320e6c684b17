"""An adapter (or one version) deleted while requests that resolved to it wait in the engine's queue: they
still load the version they resolved to, and its weights leave the store only once none uses them. Where
the weights are gone all the same (another process removed them), the request gets a 404 adapter_deleted,
not a server error, and is not counted as one."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from platform_helpers import make_settings, upload

from loraplex.platform.store_sweep import is_retired, retire, sweep

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _until(condition) -> None:
    """Wait for another thread's request to reach a point; the bound only stops a broken test hanging."""
    for _ in range(10_000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the request never got there")


@pytest.fixture
def queued(client, fake_engine):
    """Requests naming an adapter wait for a device slot until the test frees one."""
    fake_engine.slot_free = asyncio.Event()
    pool = ThreadPoolExecutor(4)
    yield pool
    client.portal.call(fake_engine.slot_free.set)
    pool.shutdown()


def _send_queued(client, fake_engine, pool, tenant, model: str):
    waiting = len(fake_engine.waiting_for_slot)
    future = pool.submit(client.post, "/v1/chat/completions", headers=tenant.headers, json={"model": model, **CHAT})
    _until(lambda: len(fake_engine.waiting_for_slot) > waiting)
    return future


def _stored(app, content_hash: str) -> bool:
    return (app.state.services.settings.resolved_adapter_store_dir / f"{content_hash}.safetensors").exists()


def _queued_then_deleted(client, make_tenant, peft_adapter_zip, fake_engine, queued):
    """A tenant's adapter "tmpv2", a request for it held in the engine's queue, then the adapter deleted."""
    tenant = make_tenant()
    content_hash = upload(client, tenant, "tmpv2", [("a.zip", peft_adapter_zip.read_bytes())]).json()["content_hash"]
    pending = _send_queued(client, fake_engine, queued, tenant, "tmpv2")
    assert client.delete("/v1/adapters/tmpv2", headers=tenant.headers).status_code == 200
    return tenant, content_hash, pending


def test_a_queued_request_loads_the_adapter_deleted_after_it_was_accepted(
        app, client, make_tenant, peft_adapter_zip, fake_engine, queued):
    tenant, content_hash, pending = _queued_then_deleted(client, make_tenant, peft_adapter_zip, fake_engine, queued)
    assert _stored(app, content_hash)  # a request accepted before the delete still needs it
    client.portal.call(fake_engine.slot_free.set)
    r = pending.result()
    assert r.status_code == 200, r.text
    assert not _stored(app, content_hash)  # and once none does, it goes
    # a request after the delete does not reach it
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={"model": "tmpv2", **CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_queued_request_loads_the_version_deleted_after_it_was_accepted(
        app, client, make_tenant, peft_adapter_zip, tiny_llama_dir, tmp_path, fake_engine, queued):
    from loraplex.testing import make_peft_adapter

    tenant = make_tenant()
    first = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    other = make_peft_adapter(tiny_llama_dir, tmp_path / "other", r=4, target_modules=("q_proj",), seed=8)
    files = [(n, (other / n).read_bytes()) for n in ("adapter_config.json", "adapter_model.safetensors")]
    second = upload(client, tenant, "bot", files).json()
    assert second["content_hash"] != first["content_hash"]
    pending = [_send_queued(client, fake_engine, queued, tenant, f"bot@{first['version']}") for _ in range(2)]
    r = client.delete(f"/v1/adapters/bot/versions/{first['id']}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert _stored(app, first["content_hash"])
    client.portal.call(fake_engine.slot_free.set)
    assert [p.result().status_code for p in pending] == [200, 200]
    assert not _stored(app, first["content_hash"]) and _stored(app, second["content_hash"])
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={"model": "bot", **CHAT})
    assert r.status_code == 200, r.text


def test_a_request_whose_adapter_weights_are_gone_gets_a_404_not_a_server_error(
        app, client, make_tenant, peft_adapter_zip, fake_engine, queued):
    tenant, content_hash, pending = _queued_then_deleted(client, make_tenant, peft_adapter_zip, fake_engine, queued)
    # another process (its sweep, an operator) removes the entry behind this one's back
    (app.state.services.settings.resolved_adapter_store_dir / f"{content_hash}.safetensors").unlink()
    client.portal.call(fake_engine.slot_free.set)
    r = pending.result()
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_deleted" and error["type"] == "invalid_request_error"
    assert "'tmpv2' was deleted before the request could start" in error["message"]
    assert not app.state.services.running and not app.state.services.leases.held(content_hash)
    client.portal.call(app.state.services.usage.flush)
    assert client.get("/v1/usage", headers=tenant.headers).json()["data"] == []  # neither billed nor failed


def test_a_streamed_request_whose_adapter_weights_are_gone_gets_a_404(
        app, client, make_tenant, peft_adapter_zip, fake_engine, queued):
    tenant = make_tenant()
    content_hash = upload(client, tenant, "tmpv2", [("a.zip", peft_adapter_zip.read_bytes())]).json()["content_hash"]
    waiting = len(fake_engine.waiting_for_slot)
    pending = queued.submit(client.post, "/v1/chat/completions", headers=tenant.headers,
                            json={"model": "tmpv2", "stream": True, **CHAT})
    _until(lambda: len(fake_engine.waiting_for_slot) > waiting)
    assert client.delete("/v1/adapters/tmpv2", headers=tenant.headers).status_code == 200
    (app.state.services.settings.resolved_adapter_store_dir / f"{content_hash}.safetensors").unlink()
    client.portal.call(fake_engine.slot_free.set)
    r = pending.result()
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_deleted"


def test_the_sweep_keeps_retired_content_for_its_grace_period_and_content_in_use_again(tmp_path, app):
    from loraplex.adapters import LocalAdapterStore
    from loraplex.platform.db import session_scope
    from loraplex.platform.models import Adapter, AdapterVersion, Tenant

    services = app.state.services
    store_dir = tmp_path / "store"
    store = LocalAdapterStore(store_dir)
    orphan, reused = "a" * 64, "b" * 64
    for h in (orphan, reused):
        (store_dir / f"{h}.safetensors").write_bytes(b"x")
    with session_scope(services.sessions) as s:
        tenant = Tenant(name="sweeper")
        s.add(tenant)
        s.flush()
        adapter = Adapter(tenant_id=tenant.id, name="again")
        s.add(adapter)
        s.flush()
        s.add(AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.id, status="ready", upload_sha256="c" * 64,
                             upload_filename="a.zip", upload_bytes=1, content_hash=reused))
    retire(store_dir, [orphan, reused])
    # not yet due: another process's engine may still hold requests for it
    assert sweep(services.sessions, store_dir, grace_seconds=3600) == []
    assert store.list() == [orphan, reused]
    assert sweep(services.sessions, store_dir, grace_seconds=0) == [orphan]
    # an upload of the same weights since the delete keeps them (checked against the database just before)
    assert store.list() == [reused]
    assert not is_retired(store_dir, orphan) and not is_retired(store_dir, reused)


def test_with_a_broker_a_delete_leaves_the_weights_to_the_sweep(tmp_path):
    """Engine processes elsewhere may hold accepted requests for the version: its weights outlive the delete
    by the grace period."""
    from loraplex.platform.services import Services

    settings = make_settings(tmp_path, adapter_store_grace_seconds=600)

    class Tasks:
        eager = False

    services = Services(settings=settings, db=None, sessions=None, limiter=None, tasks=Tasks())
    assert services.store_grace_seconds == 600
    Tasks.eager = True
    assert services.store_grace_seconds == 0


def test_the_periodic_task_and_the_start_sweep_remove_retired_content_that_is_due(app, client):
    """The worker's beat task (engine processes elsewhere) and a starting server (a stopped process kept the
    weights for its requests) both sweep the store."""
    import asyncio
    import os
    import time

    from loraplex.adapters import LocalAdapterStore
    from loraplex.platform.tasks.celery_app import app as celery_app
    from loraplex.platform.tasks.celery_app import sweep_adapter_store

    services = app.state.services
    store_dir = services.store_dir
    store = LocalAdapterStore(store_dir)
    due, recent = "d" * 64, "e" * 64
    for h in (due, recent):
        (store_dir / f"{h}.safetensors").write_bytes(b"x")
    retire(store_dir, [due, recent])
    long_ago = time.time() - services.settings.adapter_store_grace_seconds - 60
    os.utime(store_dir / ".retired" / due, (long_ago, long_ago))
    assert "sweep-adapter-store" in celery_app.conf.beat_schedule
    assert sweep_adapter_store() == 1  # the grace period of engine processes elsewhere
    assert due not in store.list() and recent in store.list()

    # a server starting with in-process tasks (grace 0, no request of its own yet) takes the rest
    assert asyncio.run(services.sweep_retired()) == [recent] and recent not in store.list()
