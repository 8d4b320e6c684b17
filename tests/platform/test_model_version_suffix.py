"""`name@` with no version is refused like a too-short version instead of being read as the latest one; the
base model, which has no versions, says so."""

from __future__ import annotations

import pytest
from platform_helpers import upload


@pytest.mark.parametrize("suffix", ["@", "@abc"])
def test_empty_or_short_version_is_model_not_found(client, make_tenant, fake_engine, peft_adapter_zip, suffix):
    tenant = make_tenant()
    r = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    before = len(fake_engine.requests)
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": f"bot{suffix}", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "characters of the version" in err["message"]
    assert len(fake_engine.requests) == before
    version = client.get("/v1/adapters/bot", headers=tenant.headers).json()["latest_version"]
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": f"bot@{version}", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("suffix", ["@", "@x", "@abcdef12"])
def test_the_base_model_takes_no_version(client, make_tenant, fake_engine, suffix):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": f"fake-base{suffix}", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "the base model 'fake-base' has no versions" in err["message"], err
    assert "characters of the version" not in err["message"]
    assert not fake_engine.requests
