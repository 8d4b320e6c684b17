"""The OpenAI-compatible endpoints against the fake engine, through the ASGI app."""

from __future__ import annotations

import json

import pytest


def _chat(client, tenant, **body):
    payload = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    payload.update(body)
    return client.post("/v1/chat/completions", headers=tenant.headers, json=payload)


def _short_body(path: str) -> dict:
    """A two-token request to the fake base model for the chat or the completions route."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == "/v1/chat/completions" else {"prompt": "hi"}
    return {"model": "fake-base", "max_tokens": 2, **prompt}


def _events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_completion_counts_usage(client, make_tenant, fake_engine):
    tenant = make_tenant()
    r = _chat(client, tenant, max_tokens=7, n=2, seed=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    prompt_len = len(fake_engine.requests[-1]["prompt_ids"])
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 14, "total_tokens": prompt_len + 14}
    assert r.headers["x-request-id"].startswith("req_")
    assert r.headers["x-ratelimit-limit-requests"] == "600"
    assert fake_engine.requests[-1]["params"].seed == 3


def test_streaming_chat_ends_with_done_and_usage(client, make_tenant):
    tenant = make_tenant()
    r = _chat(client, tenant, stream=True, stream_options={"include_usage": True}, max_completion_tokens=4)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
    non_stream = _chat(client, tenant, max_completion_tokens=4).json()
    assert text == non_stream["choices"][0]["message"]["content"]
    assert all(e["usage"] is None for e in events[:-2])


def test_completions_with_logprobs_and_stop(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": "fake-base", "prompt": "hello", "max_tokens": 6, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 6 and all(len(top) in (2, 3) for top in logprobs["top_logprobs"])
    # the two likeliest, and the sampled token (with its own value) where it is not one of them
    assert all(top[token] == value for token, value, top in
               zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True))
    stop = choice["text"][2]
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": "fake-base", "prompt": "hello", "max_tokens": 6, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]


def test_completion_batch_of_prompts(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": "fake-base", "prompt": ["one", "two"], "max_tokens": 3, "n": 2})
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as OpenAI refuses it
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
])
def test_invalid_parameters_are_400_with_param(client, make_tenant, body, param):
    tenant = make_tenant()
    r = _chat(client, tenant, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_min_p_and_repetition_penalty_reach_the_engine(client, make_tenant, fake_engine, path):
    tenant = make_tenant()
    body = _short_body(path)
    r = client.post(path, headers=tenant.headers, json={**body, "min_p": 0.1, "repetition_penalty": 1.3})
    assert r.status_code == 200, r.text
    params = fake_engine.requests[-1]["params"]
    assert (params.min_p, params.repetition_penalty) == (0.1, 1.3)
    r = client.post(path, headers=tenant.headers, json={**body, "min_p": None, "repetition_penalty": None})
    assert r.status_code == 200, r.text
    params = fake_engine.requests[-1]["params"]
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    before = len(fake_engine.requests)
    for field, value in (("min_p", "str"), ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0),
                         ("repetition_penalty", -1), ("repetition_penalty", 2.5), ("repetition_penalty", "1.1")):
        r = client.post(path, headers=tenant.headers, json={**body, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field
    assert len(fake_engine.requests) == before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_token_ids_and_the_text_options_reach_the_engine(client, make_tenant, fake_engine, path):
    tenant = make_tenant()
    body = _short_body(path)
    r = client.post(path, headers=tenant.headers, json={**body, "stop_token_ids": [5, 7],
                                                         "include_stop_str_in_output": True,
                                                         "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    params = fake_engine.requests[-1]["params"]
    assert (params.stop_token_ids, params.include_stop_str_in_output, params.skip_special_tokens) == \
        ([5, 7], True, False)
    r = client.post(path, headers=tenant.headers, json=body)
    assert r.status_code == 200, r.text
    params = fake_engine.requests[-1]["params"]
    assert (params.stop_token_ids, params.include_stop_str_in_output, params.skip_special_tokens) == \
        ([], False, True)
    before = len(fake_engine.requests)
    for field, value in (("stop_token_ids", [-1]), ("stop_token_ids", "5"), ("stop_token_ids", [1.5]),
                         ("stop_token_ids", list(range(257))), ("include_stop_str_in_output", "yes"),
                         ("skip_special_tokens", 0)):
        r = client.post(path, headers=tenant.headers, json={**body, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"].startswith(field), r.text
    assert len(fake_engine.requests) == before


def test_top_p_zero_keeps_only_the_most_likely_token(client, make_tenant, fake_engine):
    """OpenAI's API takes top_p from 0 to 1; 0 is the smallest nucleus there is, the most likely token."""
    r = _chat(client, make_tenant(), top_p=0)
    assert r.status_code == 200, r.text
    assert fake_engine.requests[-1]["params"].top_p == 0.0


def test_an_empty_prompt_starts_from_the_tokenizers_first_token(client, make_tenant, fake_engine, monkeypatch):
    """An empty text prompt is what the tokenizer makes of it: a beginning-of-text token where it adds one
    (generation starts there), and a 400 saying so where it gives no token at all."""
    tenant = make_tenant()
    body = {"model": "fake-base", "prompt": "", "max_tokens": 2}
    r = client.post("/v1/completions", headers=tenant.headers, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "gives no tokens for empty text" in r.json()["error"]["message"]
    r = client.post("/v1/completions", headers=tenant.headers, json={**body, "prompt": [[]]})
    assert r.status_code == 400 and "empty list of token ids" in r.json()["error"]["message"], r.text
    assert not fake_engine.requests
    bos = 1
    encode = fake_engine.encode
    monkeypatch.setattr(fake_engine, "encode", lambda text: [bos, *encode(text)])
    r = client.post("/v1/completions", headers=tenant.headers, json=body)
    assert r.status_code == 200, r.text
    assert fake_engine.requests[-1]["prompt_ids"] == [bos]
    assert r.json()["usage"]["prompt_tokens"] == 1


def test_a_user_too_long_is_counted_in_characters(client, make_tenant):
    r = _chat(client, make_tenant(), user="u" * 257)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
    assert "at most 256 characters" in r.json()["error"]["message"], r.text
    assert _chat(client, make_tenant(), user="u" * 256).status_code == 200


def test_malformed_json_is_400(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "application/json"},
                    content=b"{not json")
    assert r.status_code == 400 and r.headers["x-request-id"]


def test_a_json_object_sent_as_text_is_told_its_content_type(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers={**tenant.headers, "content-type": "text/plain"},
                    content=b'{"model": "fake-base", "messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and "text/plain" in message, message


def test_unknown_model_is_404(client, make_tenant):
    tenant = make_tenant()
    r = _chat(client, tenant, model="nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_key_without_inference_scope_is_403(client, make_tenant):
    tenant = make_tenant(scopes=["usage"])
    r = _chat(client, tenant)
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"


def test_usage_endpoint_groups_by_day_and_adapter(client, make_tenant, app):
    tenant = make_tenant()
    for _ in range(3):
        assert _chat(client, tenant, max_tokens=2).status_code == 200
    other = make_tenant()
    _chat(client, other, max_tokens=2)
    client.portal.call(app.state.services.usage.flush)
    r = client.get("/v1/usage", headers=tenant.headers)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 1 and data[0]["requests"] == 3 and data[0]["completion_tokens"] == 6
    assert data[0]["adapter"] is None


def test_failure_mid_stream_is_reported_in_the_stream(client, make_tenant, fake_engine, app):
    from sqlalchemy import select

    from loraplex.platform.models import UsageRecord

    tenant = make_tenant()
    fake_engine.fail_at_step = 3
    r = _chat(client, tenant, stream=True, max_tokens=10)
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and r.headers["x-request-id"] in error["message"]
    assert "device lost" not in error["message"]  # the cause goes to the log, not to the tenant
    client.portal.call(app.state.services.usage.flush)
    with app.state.services.sessions() as session:
        record = session.scalar(select(UsageRecord).where(UsageRecord.request_id == r.headers["x-request-id"]))
    assert record.status == "error" and record.completion_tokens == 3
    # the tenant's usage report marks it failed and, as billing does, leaves its tokens out
    fake_engine.fail_at_step = None
    assert _chat(client, tenant, max_tokens=4).status_code == 200
    client.portal.call(app.state.services.usage.flush)
    data = client.get("/v1/usage", headers=tenant.headers).json()["data"]
    assert [(d["requests"], d["failed_requests"], d["completion_tokens"]) for d in data] == [(2, 1, 4)]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", '{"model": "fake-base", "prompt": ["\\ud800"]}', "prompt"),
    ("/v1/chat/completions", '{"model": "x@\\ud800abcdef", "messages": [{"role": "user", "content": "hi"}]}',
     "model"),
    # stored with the usage record: it used to be served, and its record dropped by the database
    ("/v1/chat/completions", '{"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], '
                             '"user": "a\\ud800"}', "user"),
    ("/v1/completions", '{"model": "fake-base", "prompt": "hi", "user": "\\udfff"}', "user"),
])
def test_lone_surrogates_are_400_not_500(client, make_tenant, path, body, param):
    tenant = make_tenant()
    r = client.post(path, headers={**tenant.headers, "content-type": "application/json"}, content=body.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # said as what it is, also for a length-bounded field (`user`), which pydantic refuses before any check of
    # ours with "unable to parse raw data as a unicode string"
    assert "not valid Unicode" in r.json()["error"]["message"], r.text
    assert "raw data" not in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("query,param", [("start=2026-02-01&end=2026-01-01", "start"),
                                         ("start=2020-01-01&end=2026-01-01", "start"),
                                         ("end=9999-12-31", "end"), ("start=yesterday", "start")])
def test_usage_range_errors(client, make_tenant, query, param):
    tenant = make_tenant()
    r = client.get(f"/v1/usage?{query}", headers=tenant.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_min_tokens_beyond_the_token_rate_is_a_429_not_a_500(client, make_tenant):
    tenant = make_tenant(tokens_per_minute=100)
    r = _chat(client, tenant, max_tokens=None, min_tokens=90)
    assert r.status_code == 429, r.text
    assert "alone exceeds" in r.json()["error"]["message"] and r.headers["x-should-retry"] == "false"
    assert _chat(client, tenant, max_tokens=None, min_tokens=3).status_code == 200


def test_min_tokens_beyond_the_default_max_tokens_is_a_400(client, make_tenant, fake_engine):
    """Without max_tokens a chat completion may run to the end of the context, and no further: a min_tokens
    beyond that is refused as one beyond an explicit max_tokens is. A completion's default max_tokens is 16."""
    tenant = make_tenant()
    room = fake_engine.max_model_len - len(fake_engine.encode_chat([{"role": "user", "content": "hi"}]))
    for body in ({"max_tokens": None, "min_tokens": 10_000}, {"max_tokens": None, "min_tokens": room + 1},
                 {"max_tokens": 20, "min_tokens": 10_000}):
        r = _chat(client, tenant, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "leaves room for at most" in _chat(client, tenant, max_tokens=None, min_tokens=10_000).text
    assert _chat(client, tenant, max_tokens=None, min_tokens=room, ignore_eos=True).status_code == 200
    r = client.post("/v1/completions", headers=tenant.headers, json={"model": "fake-base", "prompt": "hi",
                                                                     "min_tokens": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens" and "(16)" in r.text, r.text


def test_a_request_the_engine_refuses_is_a_400_and_no_usage(client, make_tenant, fake_engine, app, monkeypatch):
    """A client error found by the engine (n above what it runs at once, say) is answered 400 and is neither
    usage nor a failed request, nor one of the per-minute limit's requests (as other 400s are not)."""
    from loraplex.engine.errors import InvalidRequestError

    async def refuse(*args, **kwargs):
        raise InvalidRequestError("n=100 is more completions than this engine runs at once", param="n")
        yield  # an async generator, as the engine's generate is

    tenant = make_tenant(requests_per_minute=10)
    monkeypatch.setattr(fake_engine, "generate", refuse)
    for stream in (False, True):
        r = _chat(client, tenant, n=100, stream=stream)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    client.portal.call(app.state.services.usage.flush)
    assert client.get("/v1/usage", headers=tenant.headers).json()["data"] == []
    monkeypatch.undo()
    r = _chat(client, tenant)
    assert r.status_code == 200  # its reservations were given back
    assert r.headers["x-ratelimit-remaining-requests"] == "9"  # and its requests: this one is the first


def test_logprobs_json_never_carries_nan_or_infinity():
    """-inf (a token a filter removed) and NaN (only a broken model gives it) are OpenAI's -9999.0: JSON has no
    NaN, and a response holding one was a 500 (or an SSE chunk no parser accepts)."""
    import json

    from loraplex.engine.outputs import Logprob, TokenLogprobs
    from loraplex.platform.inference import format as fmt

    entries = [TokenLogprobs(chosen=Logprob(1, "a", float("nan")),
                             top=[Logprob(1, "a", float("-inf")), Logprob(2, "b", -0.5)])]
    chat = fmt.chat_logprobs(entries)
    completion = fmt.completion_logprobs(entries)
    json.dumps([chat, completion], allow_nan=False)
    assert chat["content"][0]["logprob"] == -9999.0 and chat["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    assert completion["token_logprobs"] == [-9999.0] and completion["top_logprobs"] == [{"a": -9999.0, "b": -0.5}]


def test_a_model_name_of_any_length_gets_a_short_error(client, make_tenant):
    tenant = make_tenant()
    long_name = "x" * 100_000
    for r in (client.post("/v1/completions", headers=tenant.headers, json={"model": long_name, "prompt": "hi"}),
              client.get(f"/v1/models/{long_name[:7000]}", headers=tenant.headers),
              client.get(f"/v1/adapters/{long_name[:7000]}", headers=tenant.headers)):
        assert r.status_code == 404 and len(r.content) < 1000, (r.status_code, len(r.content))
        assert "characters)" in r.json()["error"]["message"]


def test_a_model_that_cannot_be_served_says_why(client, make_tenant, app):
    """No such version, an upload still being validated, an upload refused: three different answers."""
    from loraplex.platform.models import Adapter, AdapterVersion

    tenant = make_tenant()
    with app.state.services.sessions() as session:
        for name, status, code in (("early", "validating", None), ("broken", "failed", "non_finite")):
            adapter = Adapter(tenant_id=tenant.tenant_id, name=name)
            session.add(adapter)
            session.flush()
            session.add(AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.tenant_id, status=status,
                                       error="tensor 'x' holds NaN" if code else None, error_code=code,
                                       upload_sha256="0" * 64, upload_filename="a.zip", upload_bytes=1))
        session.commit()

    def message(model: str) -> str:
        r = client.post("/v1/completions", headers=tenant.headers, json={"model": model, "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        return r.json()["error"]["message"]

    assert "still being validated" in message("early")
    assert "refused at validation (non_finite: tensor 'x' holds NaN)" in message("broken")
    assert "adapter 'early' has no version 'ffffff'" in message("early@ffffff")
    assert "does not exist or you do not have access" in message("nobody")


def test_a_dropped_multi_prompt_request_is_billed_prompt_by_prompt():
    """Each prompt of a job counts for what the engine processed of it: whole once it has an output, what its
    abort reported when dropped in its prefill, nothing when dropped in the queue, and whole where the
    engine could not tell (an older engine process, a failed abort)."""
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.inference.job import InferenceJob

    job = InferenceJob(services=None, tenant=None, request_id="r", endpoint="completions", target=None,
                       prompts=[[1, 2, 3], [4, 5, 6, 7], [8, 9]], params=SamplingParams(n=2), max_new_tokens=4)
    assert job.billed_prompt_tokens == 0  # nothing sent to the engine yet
    job.generated[0] = 2
    job.prefilled.update({1: 2, 2: 0})
    assert job.billed_prompt_tokens == 3 + 2 + 0
    job.prefilled[1] = None
    assert job.billed_prompt_tokens == 3 + 4 + 0


def test_the_base_model_card_has_a_real_created_time(client, make_tenant):
    """OpenAI gives every model a Unix time; clients sort and show models by it (0 reads as 1970)."""
    import time

    tenant = make_tenant()
    listed = client.get("/v1/models", headers=tenant.headers).json()["data"]
    base = next(m for m in listed if m["id"] == "fake-base")
    one = client.get("/v1/models/fake-base", headers=tenant.headers).json()
    assert abs(base["created"] - time.time()) < 24 * 3600 and one["created"] == base["created"], (base, one)


def test_completion_batches_are_capped(client, make_tenant, fake_engine):
    """One request holds one concurrency slot: a batch of prompts (and prompts x n) has a ceiling, as OpenAI's
    2048 prompts, refused before any prompt is encoded or run."""
    tenant = make_tenant()
    for body, words in (({"prompt": ["hi"] * 2049}, "at most 2048"),
                        ({"prompt": ["hi"] * 64, "n": 64}, "4096 completions")):
        r = client.post("/v1/completions", headers=tenant.headers,
                        json={"model": "fake-base", "max_tokens": 1, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
    assert fake_engine.requests == []
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={"model": "fake-base", "max_tokens": 1, "prompt": ["hi"] * 32, "n": 64})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2048, r.text[:200]
