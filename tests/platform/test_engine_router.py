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

    router = EngineRouter(Settings(environment="test", model="m"), redis=None, tokenizer=None, max_model_len=64)
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


class _Stub:
    """An engine process as the router sees it: `fail_before` raises before any output, `fail_after` after
    the first one."""

    def __init__(self, url: str, *, fail_before: bool = False, fail_after: bool = False):
        self.url, self.inflight, self.calls = url, 0, 0
        self.fail_before, self.fail_after = fail_before, fail_after

    async def generate(self, prompt, params, request_id, *, adapter=None, tenant=None):
        from loraplex.engine.errors import EngineUnreachableError

        self.calls += 1
        if self.fail_before:
            raise EngineUnreachableError(f"engine {self.url} is unreachable: connection refused")
        yield f"{self.url}:1"
        if self.fail_after:
            raise EngineOverloadedError(f"engine {self.url} went away mid-request")
        yield f"{self.url}:2"


def _collect(router, adapter=None):
    import asyncio

    async def run():
        return [out async for out in router.generate("hi", None, "r1", adapter=adapter)]

    return asyncio.run(run())


def test_a_dead_engine_is_passed_over_for_a_live_one():
    """An engine killed (or draining) stays registered for a few seconds; a request that cannot reach it is
    served by another, and later requests skip it until its registration lapses."""
    router = _router({"a": {"resident": [ADAPTER.content_hash]}, "b": {"running": 3}})
    router.engines["a"], router.engines["b"] = _Stub("http://a", fail_before=True), _Stub("http://b")
    assert _collect(router, ADAPTER) == ["http://b:1", "http://b:2"]
    assert router.engines["a"].calls == 1
    assert _collect(router, ADAPTER) == ["http://b:1", "http://b:2"]  # not tried again meanwhile
    assert router.engines["a"].calls == 1
    assert router.choose(None).url == "http://b"  # although a is the less loaded one


def test_an_engine_lost_mid_request_is_an_error_not_a_second_answer():
    router = _router({"a": {}, "b": {"running": 3}})
    router.engines["a"], router.engines["b"] = _Stub("http://a", fail_after=True), _Stub("http://b")
    with pytest.raises(EngineOverloadedError, match="mid-request"):
        _collect(router)
    assert router.engines["b"].calls == 0


def test_when_no_engine_can_be_reached_the_request_is_unavailable():
    from loraplex.engine.errors import EngineUnreachableError

    router = _router({"a": {}, "b": {}})
    router.engines["a"], router.engines["b"] = (_Stub("http://a", fail_before=True),
                                                _Stub("http://b", fail_before=True))
    with pytest.raises(EngineUnreachableError):
        _collect(router)
    assert router.engines["a"].calls == 1 and router.engines["b"].calls == 1


def test_the_remote_client_tells_unreachable_from_lost_mid_request():
    import asyncio

    import httpx

    from loraplex.engine.errors import EngineUnreachableError
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.remote.client import RemoteEngine

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    def draining(request):
        return httpx.Response(503, text="shutting down")

    async def run(transport):
        engine = RemoteEngine("http://e", "s", model_name="m", max_model_len=64, tokenizer=None,
                              http=httpx.AsyncClient(transport=httpx.MockTransport(transport)))
        return [o async for o in engine.generate("hi", SamplingParams(max_tokens=2), "r1")]

    for transport in (refuse, draining):
        with pytest.raises(EngineUnreachableError):
            asyncio.run(run(transport))


@pytest.mark.parametrize("stream", [False, True])
def test_tenants_see_an_engine_outage_as_503_without_internal_addresses(client, make_tenant, fake_engine,
                                                                        monkeypatch, stream, caplog):
    import logging

    from loraplex.engine.errors import EngineUnreachableError

    async def unreachable(*args, **kwargs):
        raise EngineUnreachableError("engine http://10.1.2.3:8120 is unreachable: All connection attempts failed")
        yield  # an async generator, as an engine's generate is

    monkeypatch.setattr(fake_engine, "generate", unreachable)
    tenant = make_tenant()
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.inference.job"):
        r = client.post("/v1/chat/completions", headers=tenant.headers,
                        json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "stream": stream})
    assert "10.1.2.3" not in r.text and "overloaded" not in r.text
    if not stream:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "service_unavailable" and r.headers["retry-after"] == "1"
    else:
        assert "service_unavailable" in r.text or r.status_code == 503, r.text
    assert any("10.1.2.3" in rec.getMessage() for rec in caplog.records)  # the cause is in the server log


def test_a_stream_cut_by_a_lost_engine_ends_with_an_error_event_naming_the_request(client, make_tenant,
                                                                                   fake_engine, monkeypatch):
    import json

    from loraplex.engine.errors import EngineOverloadedError

    original = fake_engine.generate

    async def dies_after_one_output(*args, **kwargs):
        async for out in original(*args, **kwargs):
            yield out
            raise EngineOverloadedError("engine http://10.1.2.3:8120 went away mid-request")

    monkeypatch.setattr(fake_engine, "generate", dies_after_one_output)
    tenant = make_tenant()
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                          "stream": True})
    assert r.status_code == 200  # the stream had begun
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "10.1.2.3" not in r.text
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and r.headers["x-request-id"] in error["message"]


def test_the_api_sees_every_engines_whole_snapshot():
    """Pins, KV blocks and slots reach the API's /metrics and console from the engines' registrations (they
    used to carry only running, waiting and the adapter lists)."""
    from loraplex.engine.client import EngineStats
    from loraplex.platform.remote.protocol import stats_to_json

    one = EngineStats(num_running=2, kv_blocks_total=100, kv_blocks_used=10, lora_slots_total=8, lora_slots_used=3,
                      lora_resident=["h1"], lora_loads_total=5, extra={"lora_pinned": ["h1"]})
    two = EngineStats(num_waiting=1, kv_blocks_total=50, lora_slots_total=8, lora_resident=["h2"],
                      extra={"lora_pinned": ["h2"], "other": "kept local"})
    router = _router({"a": {"stats": stats_to_json(one)}, "b": {"stats": stats_to_json(two)},
                      "old": {"running": 4, "resident": ["h3"]}})  # an engine that publishes no snapshot
    total = router.stats()
    assert (total.num_running, total.num_waiting) == (6, 1)
    assert (total.kv_blocks_total, total.kv_blocks_used, total.lora_slots_total, total.lora_slots_used) == (150, 10,
                                                                                                            16, 3)
    assert sorted(total.lora_resident) == ["h1", "h2", "h3"] and total.lora_loads_total == 5
    assert sorted(total.extra["lora_pinned"]) == ["h1", "h2"] and total.extra["engines"] == 3


def test_readiness_follows_engines_found_unreachable():
    """An engine killed stays registered for a few seconds; meanwhile /readyz and require_engine say no engine
    is there (every request would fail), and a heartbeat newer than the failure makes it available again."""
    import asyncio
    import json

    from loraplex.engine.errors import EngineUnreachableError

    router = _router({"a": {"updated": time.time() - 1}})
    router.engines["a"] = _Stub("http://a", fail_before=True)
    assert router.available
    with pytest.raises(EngineUnreachableError):
        _collect(router)
    assert not router.available

    class Registry:  # Redis as refresh() reads it
        def __init__(self, record):
            self.record = record

        async def scan_iter(self, pattern):
            yield "k"

        async def mget(self, keys):
            return [json.dumps(self.record)]

    stale = dict(router.records["a"])
    router.redis = Registry(stale)
    asyncio.run(router.refresh())
    assert not router.available  # its last beat is older than the failure
    router.redis = Registry({**stale, "updated": time.time() + 0.01})
    asyncio.run(router.refresh())
    assert router.available


class _PinStub:
    def __init__(self, url: str, *, unreachable: bool = False):
        self.url, self.inflight, self.unreachable = url, 0, unreachable
        self.calls: list[bool | str | None] = []

    def _check(self):
        from loraplex.engine.errors import EngineUnreachableError

        if self.unreachable:
            raise EngineUnreachableError(f"engine {self.url} is unreachable: connection refused")

    async def prefetch_adapter(self, adapter, *, pin=None):
        self._check()
        self.calls.append(pin)

    async def unpin_adapter(self, content_hash):
        self._check()
        self.calls.append("unpin")


def test_a_pin_and_an_unpin_reach_every_engine():
    """An unpin that reached only the engine `choose` picks would leave the others pinned; the others are
    not made to load the adapter just to unpin it. Registrations, a heartbeat old, do not decide which
    engines get the unpin: one pinned a moment ago would not list it yet."""
    import asyncio

    router = _router({"a": {"resident": [ADAPTER.content_hash]}, "b": {}, "c": {}, "d": {}})
    stubs = {e: _PinStub(f"http://{e}", unreachable=e == "c") for e in "abcd"}
    router.engines.update(stubs)
    asyncio.run(router.prefetch_adapter(ADAPTER, pin=True))  # c is away: it syncs from the database later
    assert [stubs[e].calls for e in "abd"] == [[True], [True], [True]]
    asyncio.run(router.prefetch_adapter(ADAPTER, pin=False))  # no registration lists the pin yet
    asyncio.run(router.prefetch_adapter(ADAPTER))
    assert stubs["a"].calls == [True, False, None]  # the chosen one: prefetched and unpinned
    assert stubs["b"].calls == [True, "unpin"] and stubs["d"].calls == [True, "unpin"]
    for stub in stubs.values():
        stub.unreachable = True
    from loraplex.engine.errors import EngineUnreachableError

    with pytest.raises(EngineUnreachableError):  # no engine took it: the caller hears of it
        asyncio.run(router.prefetch_adapter(ADAPTER, pin=True))


def test_a_hung_engine_does_not_hold_a_pin_back(monkeypatch):
    """The operator's pin returns once the engines that answer have it; the hung one's change goes on behind
    it (and its pin sync covers it)."""
    import asyncio

    import loraplex.platform.remote.router as router_module

    monkeypatch.setattr(router_module, "PIN_FANOUT_WAIT_S", 0.05)

    class Hung(_PinStub):
        async def prefetch_adapter(self, adapter, *, pin=None):
            await asyncio.sleep(60)  # hung, as far as the call can tell (cancelled below)

    router = _router({"a": {"resident": [ADAPTER.content_hash]}, "b": {}})
    stubs = {"a": _PinStub("http://a"), "b": Hung("http://b")}
    router.engines.update(stubs)

    async def pin_then_stop():
        await router.prefetch_adapter(ADAPTER, pin=True)
        left = list(router._fanout)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return left

    left = asyncio.run(pin_then_stop())
    assert stubs["a"].calls == [True] and len(left) == 1  # b's pin was still on its way


def test_the_engine_server_unpins_without_loading(tmp_path, monkeypatch):
    import asyncio

    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    import loraplex.platform.pin_sync as pin_sync
    from loraplex.platform.remote.server import SECRET_HEADER, build_engine_app, engine_token

    async def no_sync(_ctx, _interval):  # this test is about the endpoint alone
        await asyncio.sleep(3600)

    monkeypatch.setattr(pin_sync, "keep_pins_in_sync", no_sync)
    settings = Settings(environment="test", data_dir=tmp_path, secret_key="s" * 32)
    engine = FakeEngine()
    engine.pinned = {ADAPTER.content_hash}
    with TestClient(build_engine_app(settings, engine, advertise="http://127.0.0.1:1")) as client:
        headers = {SECRET_HEADER: engine_token(settings.secret_key)}
        r = client.post("/engine/unpin", json={"content_hash": ADAPTER.content_hash}, headers=headers)
        assert r.json() == {"ok": True}
        r = client.post("/engine/unpin", json={"content_hash": 7}, headers=headers)
        assert r.status_code == 422 and "content_hash" in r.text
    assert engine.pinned == set() and engine.unpinned == [ADAPTER.content_hash] and engine.prefetched == []


def test_an_engine_refusing_an_adapter_is_an_adapter_error_not_an_http_error():
    import asyncio

    import httpx

    from loraplex.engine.errors import AdapterLoadError
    from loraplex.platform.remote.client import RemoteEngine

    def refuse(request):
        return httpx.Response(400, json={"error": "AdapterLoadError", "message": "corrupt safetensors file",
                                         "param": None})

    engine = RemoteEngine("http://e1", "s" * 32, model_name="m", max_model_len=64, tokenizer=None,
                          http=httpx.AsyncClient(transport=httpx.MockTransport(refuse)))
    with pytest.raises(AdapterLoadError, match="corrupt safetensors"):
        asyncio.run(engine.prefetch_adapter(ADAPTER, pin=True))


def test_an_abort_after_the_stream_closed_still_asks_the_engine_that_had_it():
    """A client that leaves closes its stream first; the abort that follows must still reach the engine that
    served the request, for what it processed of the prompt (the bill), not answer for it."""
    import asyncio

    from fake_engine import FakeEngine

    from loraplex.engine.sampling_params import SamplingParams

    router = _router({"a": {}})
    fake = FakeEngine(prefill_delay=5.0)
    fake.inflight = 0  # what the router reads of a RemoteEngine
    router.engines["a"] = fake

    async def run():
        async def consume():
            async for _ in router.generate([1, 2, 3, 4], SamplingParams(max_tokens=2), "r1"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await router.abort("r1"), await router.abort("never-sent")

    assert asyncio.run(run()) == (4, 0)


class _Registry:
    """Redis as the router's refresh() reads it: these registration records."""

    def __init__(self, *records):
        self.records = records

    async def scan_iter(self, pattern):
        for i in range(len(self.records)):
            yield f"k{i}"

    async def mget(self, keys):
        import json

        return [json.dumps(r) for r in self.records]


def _record(engine_id: str, model_name: str, **extra) -> dict:
    return {"engine_id": engine_id, "url": f"http://{engine_id}", "model_name": model_name, "max_model_len": 64,
            "running": 0, "waiting": 0, "max_num_seqs": 4, "resident": [], "host_cached": [],
            "updated": time.time(), **extra}


def test_an_engine_serving_another_base_model_is_never_chosen(caplog):
    """An engine process started with another LORAPLEX_MODEL (or left from before a model change) registers in
    the same Redis: this API process tokenizes for its own model and answers in its name, so it sends it
    nothing, says so once in its log, and routes to the engines that serve its model, wherever their copy of
    the model lies on their machine."""
    import asyncio
    import logging

    router = EngineRouter(Settings(environment="test", model="/srv/models/base-7b"), redis=None, tokenizer=None,
                          max_model_len=64)
    router.redis = _Registry(_record("other", "/srv/models/other-7b"),  # less loaded, but another model
                             _record("ours", "/mnt/cache/base-7b", running=3))
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.remote.router"):
        asyncio.run(router.refresh())
        asyncio.run(router.refresh())
    assert set(router.records) == {"ours"} and router.foreign == {"other": "other-7b"}
    assert router.choose(None).url == "http://ours"
    assert router.stats().extra["engines"] == 1
    assert len([r for r in caplog.records if "'other-7b'" in r.getMessage()]) == 1


def test_engines_that_all_serve_another_model_are_a_503_that_says_so():
    import asyncio

    from loraplex.platform.remote.server import served_name

    router = EngineRouter(Settings(environment="test", model="base-7b", served_model_name="support-base"),
                          redis=_Registry(_record("e1", "base-7b", served_model_name=served_name("base-7b"))),
                          tokenizer=None, max_model_len=64)
    asyncio.run(router.refresh())
    assert not router.available
    assert "'support-base'" in router.unavailable_reason and "base-7b" in router.unavailable_reason
    with pytest.raises(EngineOverloadedError):
        router.choose(None)
    # the engine's registration names what clients call its model: the served name where one is set
    router.redis = _Registry(_record("e1", "base-7b", served_model_name="support-base"))
    asyncio.run(router.refresh())
    assert router.available and router.choose(None).url == "http://e1"


def test_no_engine_of_the_model_is_what_the_503_and_readiness_say(client, app, make_tenant, monkeypatch):
    from loraplex.platform.services import Services

    class OnlyForeign:
        available = False
        unavailable_reason = "No engine process serves the model 'fake-base' (the registered ones serve other)."

    monkeypatch.setattr(app.state.services, "engine", OnlyForeign())
    assert Services.engine_problem(app.state.services) == OnlyForeign.unavailable_reason
    r = client.get("/readyz")
    assert r.status_code == 503 and "serves the model 'fake-base'" in r.text


def test_an_engine_started_with_another_secret_gets_no_request_and_readiness_says_so(caplog):
    """An engine process given another LORAPLEX_SECRET_KEY registers in the same Redis, but refuses every
    request this API process sends (401): it is passed over, logged once, and where it is the only engine the
    503 and /readyz name the setting rather than reporting ready and failing each request."""
    import asyncio
    import logging

    from loraplex.platform.remote.protocol import secret_fingerprint

    settings = Settings(environment="test", model="base-7b", secret_key="api-secret-0123456789")
    router = EngineRouter(settings, redis=None, tokenizer=None, max_model_len=64)
    router.redis = _Registry(_record("theirs", "base-7b", secret_fingerprint=secret_fingerprint("other-0123456789ab")),
                             _record("ours", "base-7b", running=3,
                                     secret_fingerprint=secret_fingerprint(settings.secret_key)),
                             _record("older", "base-7b", running=5))  # an engine that does not say: tried
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.remote.router"):
        asyncio.run(router.refresh())
        asyncio.run(router.refresh())
    assert set(router.records) == {"ours", "older"} and router.other_secret == {"theirs": "http://theirs"}
    assert router.choose(None).url == "http://ours"
    assert len([r for r in caplog.records if "LORAPLEX_SECRET_KEY" in r.getMessage()]) == 1

    router.redis = _Registry(_record("theirs", "base-7b", secret_fingerprint=secret_fingerprint("other-0123456789ab")))
    asyncio.run(router.refresh())
    assert not router.available
    assert "LORAPLEX_SECRET_KEY" in router.unavailable_reason and "http://theirs" not in router.unavailable_reason
    with pytest.raises(EngineOverloadedError):
        router.choose(None)


def test_an_engine_registers_the_fingerprint_of_its_secret(tmp_path):
    """The registration carries a fingerprint that matches the API process's only for the same secret."""
    import asyncio
    import json

    from loraplex.platform.remote.protocol import engine_token, secret_fingerprint
    from loraplex.platform.remote.server import _heartbeat

    assert secret_fingerprint("a-secret-0123456789") != secret_fingerprint("b-secret-0123456789")
    assert engine_token("a-secret-0123456789") not in secret_fingerprint("a-secret-0123456789")

    class Engine:
        model_name, max_model_len, failure = "base-7b", 64, None

        def stats(self):
            from loraplex.engine.client import EngineStats

            return EngineStats()

    class Redis:
        def __init__(self):
            self.written = {}

        async def set(self, key, value, ex=None):
            self.written[key] = json.loads(value)
            raise asyncio.CancelledError  # one beat is enough

    redis = Redis()
    settings = Settings(environment="test", model="base-7b", secret_key="a-secret-0123456789", data_dir=tmp_path)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_heartbeat(redis, settings, Engine(), "e1", "http://e1"))
    (record,) = redis.written.values()
    assert record["secret_fingerprint"] == secret_fingerprint("a-secret-0123456789")
