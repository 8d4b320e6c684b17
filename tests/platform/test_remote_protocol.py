"""What an engine process sends back over the wire is what the API process reads: every field of an output."""

from __future__ import annotations

import json

from loraplex.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from loraplex.platform.remote.protocol import output_from_json, output_to_json


def _round_trip(out: RequestOutput) -> RequestOutput:
    return output_from_json(json.loads(json.dumps(output_to_json(out))))


def test_a_full_output_survives_the_wire():
    lp = TokenLogprobs(chosen=Logprob(7, "a", -0.5), top=[Logprob(7, "a", -0.5), Logprob(9, "b", -1.25)])
    out = RequestOutput(
        request_id="r1", prompt="hi", prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(index=0, text="ab", token_ids=[7, 8], cumulative_logprob=-1.0, logprobs=[lp],
                                  finish_reason="stop", stop_reason="\n", delta_text="b", delta_token_ids=[8],
                                  delta_logprobs=[lp])],
        finished=True, metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, num_cached_tokens=16))
    assert _round_trip(out) == out


def test_an_adapter_load_failure_keeps_its_kind_across_the_wire():
    out = RequestOutput(request_id="r2", prompt=None, prompt_token_ids=[1],
                        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                        finished=True, error="adapter 'bot' could not be loaded: gone", error_kind="adapter_load")
    back = _round_trip(out)
    assert back == out and back.error_kind == "adapter_load"


def _engine_client(engine, monkeypatch, heartbeat: float):
    """A RemoteEngine talking to an engine app in this process (no Redis, no sockets)."""
    import httpx
    from fake_engine import FakeEngine  # noqa: F401  (the same fake the API tests use)

    from loraplex.config import Settings
    from loraplex.platform.remote import server
    from loraplex.platform.remote.client import RemoteEngine

    monkeypatch.setattr(server, "STREAM_HEARTBEAT_SECONDS", heartbeat)
    settings = Settings(environment="test", secret_key="wire-secret-0123456789")
    app = server.build_engine_app(settings, engine, advertise="http://engine")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    return RemoteEngine("http://engine", settings.secret_key, model_name="fake-base", max_model_len=256,
                        tokenizer=None, http=http), http


def test_a_slow_engine_keeps_the_stream_alive_with_blank_lines(monkeypatch):
    """While an engine works without an output (a queue, a long prefill) its stream carries blank lines, so the
    API process's read timeout tells a busy engine from a frozen one; the outputs arrive as before."""
    import asyncio

    from fake_engine import FakeEngine

    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.remote.protocol import SECRET_HEADER, engine_token

    engine = FakeEngine(token_delay=0.05)
    remote, http = _engine_client(engine, monkeypatch, heartbeat=0.01)

    async def run():
        outs = [o async for o in remote.generate("one two", SamplingParams(max_tokens=3), "r1")]
        raw = await http.post("/engine/generate", headers={SECRET_HEADER: engine_token("wire-secret-0123456789")},
                              json={"prompt": "one two", "params": {"max_tokens": 2}, "request_id": "r2"})
        return outs, raw

    outs, raw = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    lines = raw.text.split("\n")
    assert "" in lines[:-1], raw.text  # blank lines between the outputs
    assert sum(1 for line in lines if line.strip()) == 2


def test_a_request_the_engine_refuses_is_invalid_not_unavailable(monkeypatch):
    import asyncio

    import pytest
    from fake_engine import FakeEngine

    from loraplex.engine.errors import InvalidRequestError
    from loraplex.engine.sampling_params import SamplingParams

    remote, _ = _engine_client(FakeEngine(), monkeypatch, heartbeat=5.0)

    async def run():
        return [o async for o in remote.generate([], SamplingParams(max_tokens=3), "r1")]

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(run())


def test_the_api_gives_up_on_an_engine_that_sends_nothing():
    from loraplex.platform.remote import server
    from loraplex.platform.remote.client import RemoteEngine

    remote = RemoteEngine("http://engine", "s", model_name="m", max_model_len=8, tokenizer=None)
    assert remote._http.timeout.read == server.STREAM_READ_TIMEOUT
    assert server.STREAM_READ_TIMEOUT >= 5 * server.STREAM_HEARTBEAT_SECONDS


def test_an_api_process_that_leaves_before_its_request_is_read_is_no_engine_error(caplog):
    """The API process gave up (its client left) before the engine read the body: no ASGI error is logged."""
    import asyncio
    import logging

    from fake_engine import FakeEngine

    from loraplex.config import Settings
    from loraplex.platform.remote import server
    from loraplex.platform.remote.protocol import SECRET_HEADER, engine_token

    settings = Settings(environment="test", secret_key="wire-secret-0123456789")
    app = server.build_engine_app(settings, FakeEngine(), advertise="http://engine")
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/engine/generate", "raw_path": b"/engine/generate",
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("engine", 80),
             "headers": [(SECRET_HEADER.lower().encode(), engine_token(settings.secret_key).encode()),
                         (b"content-type", b"application/json"), (b"content-length", b"100")]}
    with caplog.at_level(logging.ERROR):
        asyncio.run(app(scope, receive, send))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert sent[0]["status"] == 499


def test_an_engine_process_reports_what_a_dropped_request_processed(monkeypatch):
    """Over the wire as in process: an abort answers the prompt tokens the engine processed, 0 for a request
    dropped in the queue; an engine process of an older version, whose answer has no count, reads as None
    (the API process then bills the prompt whole)."""
    import asyncio

    import httpx
    from fake_engine import FakeEngine

    from loraplex.engine.sampling_params import SamplingParams

    engine = FakeEngine(first_token_delay=0.3, prefill_delay=5.0)
    remote, http = _engine_client(engine, monkeypatch, heartbeat=0.01)

    async def leave_after(request_id: str, seconds: float) -> int | None:
        async def consume():
            async for _ in remote.generate("one two three", SamplingParams(max_tokens=3), request_id):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await remote.abort(request_id)

    async def run():
        queued = await leave_after("queued", 0.1)
        prefilling = await leave_after("prefilling", 0.6)
        remote._http = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json={"ok": True})))  # an older engine's answer
        old = await remote.abort("prefilling")
        remote._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(500)))
        failed = await remote.abort("prefilling")
        await http.aclose()
        return queued, prefilling, old, failed

    assert asyncio.run(run()) == (0, len("one two three"), None, None)
