"""Streams of several choices send one choice per chunk, each with its own index, as OpenAI and vLLM do, and
the official client puts them back together."""

from __future__ import annotations

import json

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState


def _events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_body(**extra) -> dict:
    return {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 3,
            "seed": 5, **extra}


def test_chat_stream_sends_one_choice_per_chunk(client, make_tenant):
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json=_chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200, r.text
    events = _events(r.text)
    usage = events.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 18
    assert all(len(e["choices"]) == 1 and e["usage"] is None for e in events)
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1, 2]
    texts = {i: "" for i in range(3)}
    for e in events:
        texts[e["choices"][0]["index"]] += e["choices"][0]["delta"].get("content", "")
    whole = client.post("/v1/chat/completions", headers=tenant.headers, json=_chat_body()).json()
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    finished = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]


def test_completion_stream_sends_one_choice_per_chunk(client, make_tenant):
    tenant = make_tenant()
    body = {"model": "fake-base", "prompt": ["one", "two"], "max_tokens": 4, "n": 2, "seed": 1}
    r = client.post("/v1/completions", headers=tenant.headers,
                    json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = _events(r.text)
    usage = events.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    assert all(len(e["choices"]) == 1 for e in events)
    texts: dict[int, str] = {}
    for e in events:
        choice = e["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    whole = client.post("/v1/completions", headers=tenant.headers, json=body).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_openai_client_assembles_a_stream_of_several_choices(client, make_tenant):
    tenant = make_tenant()
    api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key=tenant.key, http_client=client, max_retries=0)
    state = ChatCompletionStreamState()
    for chunk in api.chat.completions.create(**_chat_body(stream=True)):
        assert len(chunk.choices) == 1
        state.handle_chunk(chunk)
    # (get_final_completion() would refuse the finish_reason "length" these end with, as it parses content)
    assembled = state.current_completion_snapshot
    whole = api.chat.completions.create(**_chat_body())
    assert [c.message.content for c in assembled.choices] == [c.message.content for c in whole.choices]
    assert [c.index for c in assembled.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in assembled.choices)
