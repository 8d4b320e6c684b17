"""Request fields that would change the output are refused when the server cannot honour them, and a
message without content is refused instead of being sent to the model as an empty turn."""

from __future__ import annotations

import pytest


def _post(client, tenant, path, **body):
    if path == "/v1/chat/completions":
        payload = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    else:
        payload = {"model": "fake-base", "prompt": "hi", "max_tokens": 3}
    payload.update(body)
    return client.post(path, headers=tenant.headers, json=payload)


def _error(r, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert r.headers["x-request-id"].startswith("req_")
    return err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_logit_bias_is_refused_not_ignored(client, make_tenant, fake_engine, path):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    assert "logit_bias" in _error(_post(client, tenant, path, logit_bias={"5": 100}), 400, "logit_bias")
    assert len(fake_engine.requests) == before
    # an empty map asks for nothing and is what some clients always send
    assert _post(client, tenant, path, logit_bias={}).status_code == 200
    assert _post(client, tenant, path, logit_bias=None).status_code == 200


def test_json_response_format_is_refused(client, make_tenant):
    tenant = make_tenant()
    r = _post(client, tenant, "/v1/chat/completions", response_format={"type": "json_object"})
    assert "json_object" in _error(r, 400, "response_format")
    r = _post(client, tenant, "/v1/chat/completions", response_format={"type": "text"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("role", ["user", "system"])
def test_message_without_content_is_refused(client, make_tenant, fake_engine, role):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    messages = [{"role": "user", "content": "hi"}, {"role": role}]
    r = _post(client, tenant, "/v1/chat/completions", messages=messages)
    assert "required" in _error(r, 400, "messages[1].content")
    assert len(fake_engine.requests) == before


def test_assistant_turn_may_omit_content(client, make_tenant):
    tenant = make_tenant()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    assert _post(client, tenant, "/v1/chat/completions", messages=messages).status_code == 200


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),
    ({"functions": [{"name": "lookup"}]}, "functions"),
    ({"functions": [{"name": "lookup"}], "function_call": {"name": "lookup"}}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_tool_calls_and_audio_are_refused_not_ignored(client, make_tenant, fake_engine, body, param):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    message = _error(_post(client, tenant, "/v1/chat/completions", **body), 400, param)
    assert "not supported" in message
    assert len(fake_engine.requests) == before


@pytest.mark.parametrize("body", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"tools": []},
    {"tool_choice": "auto"},
    {"functions": [{"name": "lookup"}], "function_call": "none"},
    {"modalities": ["text"]},
    {"prediction": {"type": "content", "content": "x"}},
])
def test_what_leaves_the_text_answer_alone_is_accepted(client, make_tenant, body):
    assert _post(client, make_tenant(), "/v1/chat/completions", **body).status_code == 200
