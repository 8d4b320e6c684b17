"""An upload is never left pending for good: a validation task that could not be queued (the broker
unreachable) does not fail the upload, sending the same upload again queues its validation again, a database
outage in the worker is retried, and the worker's periodic sweep picks up what is still pending."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from platform_helpers import upload

from loraplex.platform.models import AdapterVersion, VersionStatus


def test_an_upload_whose_validation_cannot_be_queued_is_kept_and_resent_on_the_next_upload(
        app, client, make_tenant, peft_adapter_zip, monkeypatch):
    tenant = make_tenant()
    tasks = app.state.services.tasks
    real_send = tasks.send_async

    async def broker_down(*args, **kwargs):
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(tasks, "send_async", broker_down)
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())], wait=False)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "pending"
    monkeypatch.setattr(tasks, "send_async", real_send)
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])  # the same file again
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text


def test_the_sweep_finds_versions_pending_too_long(app, client, make_tenant, peft_adapter_zip, monkeypatch):
    from loraplex.platform.recovery import stuck_validations

    tenant = make_tenant()
    tasks = app.state.services.tasks

    async def lost(*args, **kwargs):  # queued, then lost with the broker
        return None

    monkeypatch.setattr(tasks, "send_async", lost)
    version_id = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())], wait=False).json()["id"]
    sessions = app.state.services.sessions
    assert stuck_validations(sessions) == []  # just uploaded: its task may still be on its way
    with sessions() as session:
        session.get(AdapterVersion, version_id).created_at = datetime.now(UTC) - timedelta(minutes=30)
        session.commit()
    assert stuck_validations(sessions) == [version_id]
    with sessions() as session:
        session.get(AdapterVersion, version_id).status = VersionStatus.failed.value
        session.commit()
    assert stuck_validations(sessions) == []


def test_the_worker_retries_validation_through_a_database_outage_and_sweeps():
    from sqlalchemy.exc import OperationalError

    from loraplex.config import Settings
    from loraplex.platform.tasks import celery_app

    task = celery_app.validate_adapter
    assert OperationalError in task.autoretry_for and task.max_retries >= 3
    app = celery_app.configure(Settings(environment="test"))
    schedule = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert "loraplex.resume_stuck_validations" in schedule


def test_the_same_upload_again_resumes_a_validation_whose_worker_died(app, client, make_tenant, peft_adapter_zip,
                                                                       monkeypatch):
    """The worker was killed mid-validation: the version stays "validating". Sent again after longer than a
    validation takes, the same file gets its validation sent again instead of waiting for the sweep."""
    tenant = make_tenant()
    tasks = app.state.services.tasks

    async def died(*args, **kwargs):
        return None

    real_send = tasks.send_async
    monkeypatch.setattr(tasks, "send_async", died)
    version_id = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())], wait=False).json()["id"]
    sessions = app.state.services.sessions
    with sessions() as session:
        version = session.get(AdapterVersion, version_id)
        version.status = VersionStatus.validating.value
        session.commit()
    monkeypatch.setattr(tasks, "send_async", real_send)
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())], wait=False)
    assert r.json()["id"] == version_id and r.json()["status"] == "validating"  # it may still be running
    with sessions() as session:
        session.get(AdapterVersion, version_id).created_at = datetime.now(UTC) - timedelta(minutes=3)
        session.commit()
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
