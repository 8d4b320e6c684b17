"""Request bodies other than uploads have a size limit: over it, 413 in OpenAI's error shape, before the
body is read when its length is declared, and as soon as a chunked body passes it. Uploads keep their own
(larger) limit."""

from __future__ import annotations

import json

import pytest
from platform_helpers import upload


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"max_request_bytes": 4096})


def _chat(text: str) -> dict:
    return {"model": "fake-base", "messages": [{"role": "user", "content": text}], "max_tokens": 3}


def test_a_declared_body_over_the_limit_is_413_and_never_reaches_the_engine(client, make_tenant, fake_engine):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    r = client.post("/v1/chat/completions", headers=tenant.headers, json=_chat("x" * 5000))
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert "4096 bytes" in err["message"] and r.headers["x-request-id"].startswith("req_")
    assert len(fake_engine.requests) == before
    # 3000 bytes of a field the server ignores: under the limit, so the request is served
    ok = client.post("/v1/chat/completions", headers=tenant.headers, json={**_chat("hi"), "x_padding": "x" * 3000})
    assert ok.status_code == 200, ok.text


def test_a_chunked_body_is_counted_as_it_arrives(client, make_tenant, fake_engine):
    tenant = make_tenant()
    body = json.dumps(_chat("x" * 6000)).encode()

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    before = len(fake_engine.requests)
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"},
                    content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert len(fake_engine.requests) == before
    small = json.dumps(_chat("hi")).encode()
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"},
                    content=iter([small[:10], small[10:]]))
    assert r.status_code == 200, r.text


def test_admin_bodies_are_limited_too(client, admin_key):
    r = client.post("/admin/api/tenants", headers={"Authorization": f"Bearer {admin_key}"},
                    json={"name": "acme", "pad": "x" * 5000})
    assert r.status_code == 413


def test_uploads_keep_their_own_limit(client, make_tenant, peft_adapter_zip, admin_key):
    tenant = make_tenant()
    data = peft_adapter_zip.read_bytes()
    assert len(data) > 4096
    r = upload(client, tenant, "bot", [("adapter.zip", data)])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    r = client.post(f"/admin/api/tenants/{tenant.tenant_id}/adapters", params={"wait": "true"},
                    headers={"Authorization": f"Bearer {admin_key}"}, data={"name": "by-admin"},
                    files=[("file", ("adapter.zip", data))])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text


@pytest.mark.parametrize(("path", "exempt"), [
    ("/v1/adapters", True), ("/v1/adapters/", True), ("/admin/api/tenants/12/adapters", True),
    ("/console/api/tenants/3/adapters", True), ("/v1/chat/completions", False), ("/v1/adapters/x", False),
    ("/admin/api/tenants/12/adapters/x", False), ("/console/tenants", False),
])
def test_only_the_upload_routes_take_multipart_bodies_past_the_limit(path, exempt):
    from loraplex.platform.body_limit import UPLOAD_PATHS

    assert bool(UPLOAD_PATHS.match(path)) is exempt


def test_a_multipart_body_outside_the_upload_routes_is_limited(client, make_tenant, fake_engine):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    r = client.post("/v1/chat/completions", headers=tenant.headers, files={"file": ("x.bin", b"x" * 10_000)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert len(fake_engine.requests) == before
