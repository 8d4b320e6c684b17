"""Request bodies are strict about types, as OpenAI's API is: a string or a boolean where a number or a
boolean is asked for is a 400 naming the field, not read as something else ("stream": "yes" as true,
"max_tokens": true as 1). A missing or non-object body says so."""

from __future__ import annotations

import codecs
import gzip
import json

import pytest

CHAT = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "fake-base", "prompt": "one two", "max_tokens": 3}


@pytest.mark.parametrize(("path", "base", "field", "value"), [
    ("/v1/chat/completions", CHAT, "stream", "yes"),
    ("/v1/chat/completions", CHAT, "stream", 1),
    ("/v1/chat/completions", CHAT, "max_tokens", True),
    ("/v1/chat/completions", CHAT, "max_tokens", "5"),
    ("/v1/chat/completions", CHAT, "max_tokens", 5.5),
    ("/v1/chat/completions", CHAT, "n", "2"),
    ("/v1/chat/completions", CHAT, "temperature", "0.5"),
    ("/v1/chat/completions", CHAT, "temperature", True),
    ("/v1/chat/completions", CHAT, "logprobs", 1),
    ("/v1/chat/completions", CHAT, "seed", "7"),
    ("/v1/chat/completions", CHAT, "stream_options", {"include_usage": "yes"}),
    ("/v1/completions", COMPLETION, "echo", "false"),
    ("/v1/completions", COMPLETION, "logprobs", True),
    ("/v1/completions", COMPLETION, "max_tokens", False),
])
def test_a_value_of_the_wrong_type_is_refused_by_name(client, make_tenant, fake_engine, path, base, field, value):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    r = client.post(path, headers=tenant.headers, json={**base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field or err["param"].startswith(f"{field}."), err
    assert len(fake_engine.requests) == before  # nothing reached the engine


@pytest.mark.parametrize(("field", "value"), [("temperature", 1), ("top_p", 1), ("stream", False),
                                              ("max_tokens", 2), ("seed", None), ("presence_penalty", 0)])
def test_values_of_the_right_type_still_pass(client, make_tenant, field, value):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={**CHAT, field: value})
    assert r.status_code == 200, r.text


def test_a_missing_or_non_object_body_says_so(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"})
    assert r.status_code == 400
    assert "no body" in r.json()["error"]["message"]
    for body in ("[]", "5", '"text"'):
        r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"},
                        content=body)
        assert r.status_code == 400, body
        assert "must be a JSON object" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("post", "/admin/api/plans", {"name": "gold", "requests_per_minute": "10", "tokens_per_minute": 100,
                                  "max_concurrent": 2, "monthly_token_budget": 1000}, "requests_per_minute"),
    ("post", "/admin/api/tenants", {"name": "acme2", "max_concurrent": True}, "max_concurrent"),
    ("patch", "/admin/api/tenants/{tenant}", {"tokens_per_minute": "100"}, "tokens_per_minute"),
    ("put", "/admin/api/billing/prices/default",
     {"prompt_price": True, "completion_price": 1, "adapter_surcharge_price": 0}, "prompt_price"),
    ("post", "/admin/api/billing/statements/finalize", {"period": 202610}, "period"),
])
def test_admin_bodies_are_strict_too(client, admin_key, make_tenant, method, path, body, field):
    tenant = make_tenant()
    r = getattr(client, method)(path.format(tenant=tenant.tenant_id),
                                headers={"Authorization": f"Bearer {admin_key}"}, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(("path", "base", "fields"), [
    ("/v1/chat/completions", CHAT, ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                                    "logprobs", "stream", "seed", "stop", "user", "top_logprobs")),
    ("/v1/completions", COMPLETION, ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                                     "stream", "echo", "logprobs", "best_of", "suffix")),
])
def test_null_means_the_default(client, make_tenant, fake_engine, path, base, fields):
    """OpenAI's parameters are nullable and the SDKs send null for a None argument: null takes the default."""
    tenant = make_tenant()
    r = client.post(path, headers=tenant.headers, json={**base, **dict.fromkeys(fields),
                                                        "stream_options": None})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # stream: null is not a stream
    params = fake_engine.requests[-1]["params"]
    assert (params.n, params.temperature, params.top_p, params.presence_penalty) == (1, 1.0, 1.0, 0.0)
    assert params.logprobs is None and len(r.json()["choices"]) == 1
    r = client.post(path, headers=tenant.headers,
                    json={**base, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage":{' not in r.text.replace(" ", ""), r.text


def test_a_value_that_fits_no_branch_of_a_union_is_named_plainly(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json={**CHAT, "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages[0].content", error
    assert "string" in error["message"] and "list" in error["message"] and "more problem" not in error["message"]
    r = client.post("/v1/completions", headers=tenant.headers, json={**COMPLETION, "prompt": 3.5})
    assert r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize(("field", "token"), [("temperature", "NaN"), ("presence_penalty", "Infinity"),
                                              ("frequency_penalty", "-Infinity"), ("top_p", "NaN")])
def test_nan_and_infinity_are_not_json(client, make_tenant, fake_engine, field, token):
    """Python's json.loads reads NaN and Infinity; they are not JSON, so the body is refused as unparsable
    (naming the token), not validated and reported as a number out of range."""
    tenant = make_tenant()
    before = len(fake_engine.requests)
    body = '{"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "FIELD": TOKEN}'
    body = body.replace("FIELD", field).replace("TOKEN", token)
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"},
                    content=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("We could not parse the JSON body of your request: "), error
    assert f"{token} is not valid JSON" in error["message"] and "less than" not in error["message"]
    assert len(fake_engine.requests) == before
    text = '{"model": "fake-base", "prompt": "one", "temperature": TOKEN}'.replace("TOKEN", token)
    r = client.post("/v1/completions", headers={**tenant.headers, "content-type": "application/json"}, content=text)
    assert r.status_code == 400 and token in r.json()["error"]["message"], r.text


def test_nan_is_refused_in_admin_and_console_bodies_too(client, admin_key, make_tenant):
    from console_helpers import Console

    tenant = make_tenant()
    r = client.patch(f"/admin/api/tenants/{tenant.tenant_id}",
                     headers={"Authorization": f"Bearer {admin_key}", "content-type": "application/json"},
                     content='{"tokens_per_minute": NaN}')
    assert r.status_code == 400 and "NaN is not valid JSON" in r.json()["error"]["message"], r.text
    console = Console(client=client, app=client.app, admin_key=admin_key)
    console.sign_in()
    r = client.post("/console/api/playground/chat", headers={"x-csrf-token": console.csrf,
                                                             "content-type": "application/json"},
                    content=json.dumps({"tenant_id": tenant.tenant_id, "model": "fake-base", "temperature": 1.5,
                                        "messages": [{"role": "user", "content": "hi"}]}).replace("1.5", "Infinity"))
    assert r.status_code == 400 and "Infinity is not valid JSON" in r.json()["error"]["message"], r.text


def _api_routes(routes) -> list:
    """The app's routes, through the routers it includes (FastAPI keeps an included router whole)."""
    from fastapi.routing import APIRoute

    out = []
    for route in routes:
        if isinstance(route, APIRoute):
            out.append(route)
        elif hasattr(route, "original_router"):
            out += _api_routes(route.original_router.routes)
        elif hasattr(route, "routes"):
            out += _api_routes(route.routes)
    return out


def test_every_route_parses_json_strictly(app):
    """A router added later without route_class=StrictJsonRoute would read NaN again: every route is checked."""
    from loraplex.platform.strict_json import StrictJsonRoute

    routes = _api_routes(app.routes)
    assert len(routes) > 30
    assert sorted(r.path for r in routes if not isinstance(r, StrictJsonRoute)) == []


JSON = {"content-type": "application/json"}
NOT_UTF8 = b'{"model": "fake-base", "prompt": "caf\xe9", "max_tokens": 3}'


@pytest.mark.parametrize(("body", "words"), [
    (NOT_UTF8, "not UTF-8 text: byte 0xe9 at byte offset 37"),
    (codecs.BOM_UTF8 + NOT_UTF8, "not UTF-8 text: byte 0xe9 at byte offset 40"),
    # json.loads would guess these from their NUL bytes and read them
    (json.dumps(COMPLETION).encode("utf-16-le"), "byte 0x00 at byte offset 1 is a NUL"),
    (json.dumps(COMPLETION).encode("utf-16-be"), "byte 0x00 at byte offset 0 is a NUL"),
    (json.dumps(COMPLETION).encode("utf-16"), "byte 0xff at byte offset 0 is not valid UTF-8"),
    (json.dumps(COMPLETION).encode("utf-32-le"), "byte 0x00 at byte offset 1 is a NUL"),
    (gzip.compress(json.dumps(COMPLETION).encode()), "byte 0x8b at byte offset 1"),
    (b'{"model": "fake-base", "prompt": "hi", "seed": ' + b"7" * 5000 + b"}", "more than 4300 digits"),
    (b'{"model": "fake-base", "prompt": "hi", "temperature": 1e999}', "1e999 is not valid JSON (the number is too"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"model": "fake-base", "prompt": "hi",}', "Expecting property name enclosed in double quotes (line 1 column"),
])
def test_each_way_a_body_is_not_json_has_its_own_message(client, make_tenant, fake_engine, body, words):
    r = client.post("/v1/completions", headers={**make_tenant().headers, **JSON}, content=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["message"].startswith("We could not parse the JSON body of your request: "), error
    assert words in error["message"] and "NaN" not in error["message"], error
    assert not fake_engine.requests


def test_a_utf8_body_may_start_with_a_byte_order_mark(client, make_tenant):
    r = client.post("/v1/completions", headers={**make_tenant().headers, **JSON},
                    content=codecs.BOM_UTF8 + json.dumps(COMPLETION).encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_415(client, make_tenant, fake_engine, encoding):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers={**tenant.headers, **JSON, "content-encoding": encoding},
                    content=gzip.compress(json.dumps(COMPLETION).encode()))
    assert r.status_code == 415, r.text
    assert r.json() == {"error": {"message": f"Compressed request bodies are not accepted (Content-Encoding: "
                                             f"'{encoding}'); send the body uncompressed.",
                                  "type": "invalid_request_error", "param": None, "code": "unsupported_media_type"}}
    assert not fake_engine.requests
    r = client.post("/v1/completions", headers={**tenant.headers, **JSON, "content-encoding": "identity"},
                    json=COMPLETION)
    assert r.status_code == 200, r.text


def test_a_compressed_upload_is_415(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/adapters", headers={**tenant.headers, "content-encoding": "gzip"},
                    data={"name": "bot"}, files={"file": ("a.zip", gzip.compress(b"zip"))})
    assert r.status_code == 415 and "Compressed" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("content_type", ["text/json", "application/jsonx", "application/x-json", "text/plain",
                                          "application/json-patch"])
def test_a_json_object_not_sent_as_application_json_is_told_its_content_type(client, make_tenant, content_type):
    r = client.post("/v1/completions", headers={**make_tenant().headers, "content-type": content_type},
                    content=json.dumps(COMPLETION))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "sent with Content-Type: application/json" in message and repr(content_type) in message, message
    assert "valid dictionary" not in message


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_are_read(client, make_tenant, content_type):
    r = client.post("/v1/completions", headers={**make_tenant().headers, "content-type": content_type},
                    content=json.dumps(COMPLETION))
    assert r.status_code == 200, r.text


UNREADABLE = [({**JSON}, b"{bad"), ({**JSON}, b'{"temperature": NaN}'), ({**JSON}, NOT_UTF8),
              ({**JSON, "content-encoding": "gzip"}, gzip.compress(b"{}")),
              ({"content-type": "text/plain"}, b"{bad"), ({"content-type": "application/x-www-form-urlencoded"},
                                                          b"{bad")]


@pytest.mark.parametrize(("headers", "body"), UNREADABLE)
def test_a_caller_without_a_valid_key_hears_of_that_before_its_body(client, make_tenant, fake_engine, admin_key,
                                                                     headers, body):
    """Authentication comes first: a body that cannot be read is answered only to a caller allowed to send it."""
    for auth, status in (({}, 401), ({"Authorization": "Bearer lpx_nope"}, 401),
                         (make_tenant(scopes=["usage"]).headers, 403)):
        r = client.post("/v1/chat/completions", headers={**headers, **auth}, content=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] in ("authentication_error", "permission_error")
    r = client.patch("/admin/api/tenants/1", headers=headers, content=body)
    assert r.status_code == 401, r.text
    r = client.post("/v1/chat/completions", headers={**headers, **make_tenant().headers}, content=body)
    assert r.status_code in (400, 415) and r.json()["error"]["type"] == "invalid_request_error", r.text
    tenant = make_tenant()
    r = client.patch(f"/admin/api/tenants/{tenant.tenant_id}",
                     headers={**headers, "Authorization": f"Bearer {admin_key}"}, content=body)
    assert r.status_code in (400, 415) and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert not fake_engine.requests
