"""A long prompt is tokenized off the event loop, so one huge request cannot stall every other one."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class LoopRecordingEngine(FakeEngine):
    """Records, for each tokenization, whether it ran on the thread of a running event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded_on_loop: list[bool] = []

    def encode(self, text):
        self.encoded_on_loop.append(_on_event_loop())
        return super().encode(text)

    def encode_chat(self, messages, *, add_generation_prompt=True):
        self.encoded_on_loop.append(_on_event_loop())
        return super().encode_chat(messages, add_generation_prompt=add_generation_prompt)


@pytest.fixture
def fake_engine() -> LoopRecordingEngine:
    """Overrides the area's fixture, so the usual app and make_tenant fixtures use this engine."""
    return LoopRecordingEngine()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "word " * 20_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 20_000}]}),
])
def test_long_prompt_is_tokenized_off_the_event_loop(client, make_tenant, fake_engine, path, body):
    tenant = make_tenant()
    r = client.post(path, headers=tenant.headers, json={"model": "fake-base", "max_tokens": 2, **body})
    # the fake engine's context is short: the prompt is tokenized, then refused for its length
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert fake_engine.encoded_on_loop and not any(fake_engine.encoded_on_loop)
