"""The OpenAPI document names every media type a route answers with: a client generated from it (or a schema
fuzzer checking answers against it) meets no undocumented Content-Type."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("method", "path", "media_type"), [
    ("post", "/v1/chat/completions", "text/event-stream"),
    ("post", "/v1/completions", "text/event-stream"),
    ("get", "/v1/usage", "text/csv"),
    ("get", "/v1/usage/report", "text/csv"),
    ("get", "/v1/billing/statements/{period}", "text/csv"),
    ("get", "/admin/api/billing/report", "text/csv"),
    ("get", "/admin/api/billing/statements", "text/csv"),
    ("get", "/admin/api/billing/statements/{tenant_id}/{period}", "text/csv"),
])
def test_each_media_type_a_route_answers_with_is_documented(client, method, path, media_type):
    content = client.get("/openapi.json").json()["paths"][path][method]["responses"]["200"]["content"]
    assert {"application/json", media_type} <= set(content), content


def test_a_streamed_completion_comes_as_the_documented_type(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": "fake-base", "prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == "text/event-stream"


@pytest.mark.parametrize(("path", "choices"), [
    ("/v1/usage/report", ["day", "key", "adapter"]),
    ("/admin/api/billing/report", ["day", "tenant", "key", "adapter"]),
])
def test_group_by_is_documented_with_the_values_the_route_takes(client, path, choices):
    params = client.get("/openapi.json").json()["paths"][path]["get"]["parameters"]
    described = next(p for p in params if p["name"] == "group_by")["description"]
    assert described == f"comma-separated subset of {', '.join(choices)}"
