"""A request without max_tokens from a tenant whose token rate is below the context gets the completion
budget its rate allows, instead of a 429 on every such request."""

from __future__ import annotations


def _chat(client, tenant, **body):
    payload = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}]}
    payload.update(body)
    return client.post("/v1/chat/completions", headers=tenant.headers, json=payload)


def test_unset_max_tokens_fits_the_token_rate(client, make_tenant, fake_engine):
    # the fake engine's context is 256 tokens; this tenant may use 100 tokens per minute
    tenant = make_tenant(tokens_per_minute=100)
    r = _chat(client, tenant)
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_len = len(fake_engine.requests[-1]["prompt_ids"])
    assert body["usage"]["completion_tokens"] == 100 - prompt_len
    assert body["choices"][0]["finish_reason"] == "length"
    assert fake_engine.requests[-1]["params"].max_tokens == 100 - prompt_len
    # the minute's tokens are now spent: the next request is refused by the rate limit, not let through
    r = _chat(client, tenant)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_unset_max_tokens_with_n_splits_the_budget(client, make_tenant, fake_engine):
    tenant = make_tenant(tokens_per_minute=120)
    r = _chat(client, tenant, n=3, max_tokens=None)
    assert r.status_code == 200, r.text
    prompt = len(fake_engine.requests[-1]["prompt_ids"])
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= 120
    assert usage["completion_tokens"] == 3 * ((120 - prompt) // 3)


def test_text_completions_with_max_tokens_null_get_the_default(client, make_tenant, fake_engine):
    """OpenAI treats an explicit null as the default (16); running to the end of the context instead would
    bill a client that sends null for 'not set' for thousands of tokens."""
    tenant = make_tenant()
    for stream in (False, True):
        r = client.post("/v1/completions", headers=tenant.headers,
                        json={"model": "fake-base", "prompt": ["one two", "three four"], "n": 2,
                              "max_tokens": None, "stream": stream})
        assert r.status_code == 200, r.text
        assert all(q["params"].max_tokens == 16 for q in fake_engine.requests[-2:])


def test_explicit_max_tokens_is_not_rewritten(client, make_tenant, fake_engine):
    tenant = make_tenant(tokens_per_minute=100)
    r = _chat(client, tenant, max_tokens=200)
    assert r.status_code == 429
    assert "exceeds the limit" in r.json()["error"]["message"]
    big = make_tenant()
    r = _chat(client, big)  # a large limit: the whole context stays available
    assert r.status_code == 200
    assert fake_engine.requests[-1]["params"].max_tokens is None


def test_text_completions_default_to_16_tokens_as_openai_does(client, make_tenant, fake_engine):
    tenant = make_tenant()
    r = client.post("/v1/completions", headers=tenant.headers, json={"model": "fake-base", "prompt": "one two"})
    assert r.status_code == 200, r.text
    assert fake_engine.requests[-1]["params"].max_tokens == 16
    assert r.json()["usage"]["completion_tokens"] <= 16
    # chat completions keep no default: up to the context
    r = _chat(client, tenant)
    assert r.status_code == 200 and fake_engine.requests[-1]["params"].max_tokens is None


def test_unset_max_tokens_fits_what_is_left_of_the_monthly_budget(client, make_tenant, fake_engine):
    """A budget below the context (256) still serves a request without max_tokens, to what is left of it."""
    tenant = make_tenant(monthly_token_budget=150)
    r = _chat(client, tenant)
    assert r.status_code == 200, r.text
    first = r.json()["usage"]["total_tokens"]
    assert first == 150 and r.json()["choices"][0]["finish_reason"] == "length"
    tenant2 = make_tenant(monthly_token_budget=200)
    used = _chat(client, tenant2, max_tokens=5).json()["usage"]["total_tokens"]
    r = _chat(client, tenant2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 200 - used  # the rest of the month, not the whole budget
    r = _chat(client, tenant2)  # nothing left: the budget's 429, not a one-token answer
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"


def test_unset_max_tokens_fits_what_is_left_of_the_minute(app, client, make_tenant, fake_engine):
    """After a first request in a minute, one without max_tokens gets the rest of the minute's tokens, not a
    429 for asking the whole per-minute limit again."""
    import time

    pinned = time.time()
    app.state.services.limiter._clock = lambda: pinned  # every request in one rate window
    tenant = make_tenant(tokens_per_minute=200)  # below the 256-token context
    used = _chat(client, tenant, max_tokens=5).json()["usage"]["total_tokens"]
    r = _chat(client, tenant)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 200 - used
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = _chat(client, tenant)  # the minute is spent: the rate limit's 429, with the time to wait
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1


def test_rate_headers_of_a_whole_response_count_the_tokens_used(client, make_tenant, fake_engine):
    """A response that is not streamed goes out after its request settled: x-ratelimit-remaining-tokens
    counts what it used, not the reservation an unset max_tokens made (the rest of the context)."""
    fake_engine.eos_rate = 2  # completions end early, far below what was reserved
    tenant = make_tenant(tokens_per_minute=10_000)
    r = _chat(client, tenant)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    assert used < 256 - len(fake_engine.requests[-1]["prompt_ids"])  # less than the context it could take
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 10_000 - used


def test_rate_headers_of_a_stream_count_its_reservation(client, make_tenant, fake_engine):
    """A stream's headers go out before its first token: they count the whole reservation."""
    tenant = make_tenant(tokens_per_minute=10_000)
    r = _chat(client, tenant, stream=True, max_tokens=40)
    assert r.status_code == 200, r.text
    prompt = len(fake_engine.requests[-1]["prompt_ids"])
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 10_000 - prompt - 40
