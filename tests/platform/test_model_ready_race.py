"""A version whose validation finishes while a request resolves its adapter is served, not answered with a 404
saying the adapter has no ready version (the lookup of ready versions and the read of the adapter that explains
a miss are two statements, and the validation may commit between them)."""

from __future__ import annotations

import pytest
from platform_helpers import upload
from sqlalchemy import update

from loraplex.platform.db import session_scope
from loraplex.platform.models import AdapterVersion, VersionStatus
from loraplex.platform.scoping import TenantScope


def _set_status(app, version_id: int, status: str) -> None:
    with session_scope(app.state.services.sessions) as session:
        session.execute(update(AdapterVersion).where(AdapterVersion.id == version_id).values(status=status))


@pytest.mark.parametrize("with_version", [False, True])
def test_version_that_becomes_ready_between_the_reads_is_served(app, client, make_tenant, fake_engine,
                                                                 peft_adapter_zip, monkeypatch, with_version):
    tenant = make_tenant()
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    version_id, version = r.json()["id"], r.json()["version"]
    # the validation is still under way when the request looks for a ready version ...
    _set_status(app, version_id, VersionStatus.validating.value)
    real = TenantScope.one_or_none
    finished = []

    def one_or_none(self, model, *criteria):
        # ... and commits before the request reads the adapter to say why it found none
        if not finished:
            finished.append(True)
            _set_status(app, version_id, VersionStatus.ready.value)
        return real(self, model, *criteria)

    monkeypatch.setattr(TenantScope, "one_or_none", one_or_none)
    model = f"bot@{version}" if with_version else "bot"
    r = client.post("/v1/completions", headers=tenant.headers, json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert finished, "the request did not take the path that explains a miss"
    assert r.status_code == 200, r.text
    assert fake_engine.requests[-1]["adapter"].content_hash.startswith(version)


def test_a_version_still_validating_is_still_not_ready(app, client, make_tenant, peft_adapter_zip):
    tenant = make_tenant()
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    _set_status(app, r.json()["id"], VersionStatus.validating.value)
    r = client.post("/v1/completions", headers=tenant.headers, json={"model": "bot", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    assert "still being validated" in r.json()["error"]["message"]
