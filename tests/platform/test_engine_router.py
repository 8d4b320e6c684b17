"""Routing between engine processes: adapter holders first, unless overloaded; else the least loaded."""

from __future__ import annotations

import time

import pytest

from loraplex.config import Settings
from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.lora_request import LoRARequest
from loraplex.platform.remote.router import EngineRouter

ADAPTER = LoRARequest(name="a", content_hash="ab" * 32, path="/x")


def _router(records: dict[str, dict]) -> EngineRouter:
    from loraplex.platform.remote.client import RemoteEngine

    router = EngineRouter(Settings(environment="test"), redis=None, tokenizer=None, max_model_len=64)
    for engine_id, rec in records.items():
        router.records[engine_id] = {"engine_id": engine_id, "url": f"http://{engine_id}", "model_name": "m",
                                     "max_model_len": 64, "running": 0, "waiting": 0, "max_num_seqs": 4,
                                     "resident": [], "host_cached": [], "updated": time.time(), **rec}
        router.engines[engine_id] = RemoteEngine(f"http://{engine_id}", "s", model_name="m", max_model_len=64,
                                                 tokenizer=None)
    return router


def test_prefers_the_engine_holding_the_adapter():
    router = _router({"a": {"running": 1}, "b": {"running": 3, "resident": [ADAPTER.content_hash]}})
    assert router.choose(ADAPTER).url == "http://b"
    assert router.choose(None).url == "http://a"


def test_device_slot_beats_host_cache():
    router = _router({"a": {"host_cached": [ADAPTER.content_hash]}, "b": {"running": 2,
                                                                          "resident": [ADAPTER.content_hash]}})
    assert router.choose(ADAPTER).url == "http://b"


def test_overloaded_holder_is_skipped():
    router = _router({"a": {"running": 1}, "b": {"running": 4, "waiting": 5, "resident": [ADAPTER.content_hash]}})
    assert router.choose(ADAPTER).url == "http://a"


def test_no_engine_means_unavailable():
    router = _router({})
    assert not router.available
    with pytest.raises(EngineOverloadedError):
        router.choose(None)
