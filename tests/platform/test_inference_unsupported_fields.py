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
    assert "'json_object' is not supported" in _error(r, 400, "response_format")
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


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "none"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"function_call": "none"}, "function_call"),
])
def test_a_tool_choice_without_tools_is_refused(client, make_tenant, body, param):
    """As OpenAI's API: a choice among no tools is a mistake in the request, whatever the choice."""
    message = _error(_post(client, make_tenant(), "/v1/chat/completions", **body), 400, param)
    assert "only allowed when" in message


@pytest.mark.parametrize("body", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"tools": []},
    {"tools": None, "tool_choice": None},
    {"functions": [{"name": "lookup"}], "function_call": "none"},
    {"modalities": ["text"]},
    {"store": False, "service_tier": "auto", "parallel_tool_calls": True, "metadata": {"team": "ops"},
     "prompt_cache_key": "k1", "safety_identifier": "user-1"},
    {"web_search_options": None, "prediction": None, "reasoning_effort": None, "guided_json": None,
     "use_beam_search": False, "length_penalty": 1.0},
    {"a_field_no_api_defines": {"x": 1}},
])
def test_what_leaves_the_text_answer_alone_is_accepted(client, make_tenant, body):
    assert _post(client, make_tenant(), "/v1/chat/completions", **body).status_code == 200


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "web_search_options", "str"),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "verbosity", "high"),
    ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "[a-z]+"),
    ("/v1/completions", "guided_choice", ["yes", "no"]),
    ("/v1/completions", "structured_outputs", {"json": {}}),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "length_penalty", 1.2),
])
def test_fields_the_server_cannot_honour_are_refused_by_name(client, make_tenant, fake_engine, path, field, value):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    message = _error(_post(client, tenant, path, **{field: value}), 400, field)
    assert f"{field} is not supported" in message
    assert len(fake_engine.requests) == before
    assert _post(client, tenant, path, **{field: None}).status_code == 200


@pytest.mark.parametrize(("field", "value"), [("parallel_tool_calls", "yes"), ("metadata", {"a": 1}),
                                              ("store", "no"), ("prompt_cache_key", 5)])
def test_fields_accepted_as_hints_are_still_typed(client, make_tenant, field, value):
    r = _post(client, make_tenant(), "/v1/chat/completions", **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


@pytest.mark.parametrize(("response_format", "param", "words"), [
    ({}, "response_format.type", "Missing required parameter"),
    ({"a": 1}, "response_format.type", "Missing required parameter"),
    ({"type": 5}, "response_format.type", "string"),
    ({"type": "yaml"}, "response_format.type", "'yaml'; supported values are"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "response_format", "not supported"),
    ("text", "response_format", "object"),
])
def test_a_response_format_needs_a_known_type(client, make_tenant, fake_engine, response_format, param, words):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    r = _post(client, tenant, "/v1/chat/completions", response_format=response_format)
    assert words in _error(r, 400, param)
    assert len(fake_engine.requests) == before
    r = _post(client, tenant, "/v1/chat/completions", response_format={"type": "text", "other": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "text"}, "messages[0].content[0].text", "has no 'text' field"),
    ({"type": "text", "text": 5}, "messages[0].content[0].text", "must be a string"),
    ({"text": "hi"}, "messages[0].content[0]", "has no 'type'"),
    ({"type": "image_url", "image_url": {"url": "http://x"}}, "messages[0].content[0]", "got 'image_url'"),
    ({"type": "refusal", "refusal": "no"}, "messages[0].content[0]", "only allowed in assistant messages"),
])
def test_a_content_part_that_cannot_be_read_says_why(client, make_tenant, fake_engine, part, param, words):
    tenant = make_tenant()
    before = len(fake_engine.requests)
    r = _post(client, tenant, "/v1/chat/completions", messages=[{"role": "user", "content": [part]}])
    message = _error(r, 400, param)
    assert words in message and "got 'text'" not in message
    assert len(fake_engine.requests) == before


def test_an_assistant_refusal_is_what_the_assistant_said(client, make_tenant, fake_engine):
    """OpenAI's API takes a refusal part (or the `refusal` field) in an assistant turn: the conversation goes
    on with that text as the assistant's."""
    tenant = make_tenant()
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Well, "},
                                                  {"type": "refusal", "refusal": "I cannot help."}]},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": None, "refusal": "Still no."},
                {"role": "user", "content": "please"}]
    assert _post(client, tenant, "/v1/chat/completions", messages=messages).status_code == 200
    prompt = bytes(fake_engine.requests[-1]["prompt_ids"]).decode()
    assert "<assistant>Well, I cannot help.\n" in prompt and "<assistant>Still no.\n" in prompt
