"""AsyncEngine: background steps, one stream per request, deltas, abort frees blocks at once."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.client import EngineClient
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama_dir):
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=64))
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_streams_match_offline_generation(engine, tiny_llama_dir):
    assert isinstance(engine, EngineClient)
    prompts = ["The quick brown fox", "Hello world", "Grüße aus München"]
    expected = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)

    async def collect(i, prompt):
        text, tokens, last = "", [], None
        async for out in engine.generate(prompt, GREEDY, f"req-{i}"):
            text += out.outputs[0].delta_text
            tokens += out.outputs[0].delta_token_ids
            last = out
        return text, tokens, last

    results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))
    for (text, tokens, last), exp in zip(results, expected, strict=True):
        assert tokens == exp.outputs[0].token_ids == last.outputs[0].token_ids
        assert text == exp.outputs[0].text == last.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"
    stats = engine.stats()
    assert stats.generation_tokens_total == 36 and stats.kv_blocks_used == 0


async def test_bad_request_raises_before_streaming(engine):
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate("", GREEDY, "bad"):
            pass
    out = [o async for o in engine.generate("Hello", GREEDY, "good")]
    assert out[-1].finished


async def test_disconnect_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate("Hello world", params, "long")
    async for out in stream:
        if len(out.outputs[0].token_ids) >= 3:
            break
    assert engine.stats().kv_blocks_used > 0
    await stream.aclose()
    await engine.abort("long")  # idempotent; returns after the step thread has processed it
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


async def test_explicit_abort_ends_the_stream(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    outs = []

    async def consume():
        async for out in engine.generate("Hello", params, "a"):
            outs.append(out)

    task = asyncio.create_task(consume())
    while not outs:
        await asyncio.sleep(0.01)
    await engine.abort("a")
    assert engine.stats().kv_blocks_used == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_unset_max_tokens_with_several_completions_fits_the_cache(tiny_llama_dir):
    # 8 blocks of 16 tokens: the tiny model's 512-token context does not fit twice, so an unset max_tokens
    # with n=2 runs each completion up to what the cache holds for both, instead of being refused.
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=8, block_size=16))
    await eng.start()
    try:
        params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=None, ignore_eos=True)
        prompt_len = len(eng.encode("Hello world"))
        outs = [o async for o in eng.generate("Hello world", params, "unset")]
        last = outs[-1]
        assert last.finished and len(last.outputs) == 2
        shared = prompt_len // 16
        room = (shared + (8 - shared) // 2) * 16 - prompt_len
        for comp in last.outputs:
            assert comp.finish_reason == "length" and len(comp.token_ids) == room
        assert eng.stats().kv_blocks_used == 0
        with pytest.raises(InvalidRequestError, match="KV cache blocks"):
            async for _ in eng.generate("Hello world", SamplingParams(n=9, max_tokens=None), "too-many"):
                pass
    finally:
        await eng.shutdown()


async def test_more_completions_than_max_num_seqs_are_refused_not_left_waiting(tiny_llama_dir):
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=64, max_num_seqs=4))
    await eng.start()
    try:
        with pytest.raises(InvalidRequestError, match="max_num_seqs=4"):
            async for _ in eng.generate("Hello world", SamplingParams(n=5, max_tokens=3), "too-many"):
                pass
        assert eng.stats().num_waiting == 0
        outs = [o async for o in eng.generate("Hello world", SamplingParams(n=4, max_tokens=3), "fits")]
        assert outs[-1].finished and len(outs[-1].outputs) == 4
        assert eng.engine.last_step_idle is False  # the last step ran the request
    finally:
        await eng.shutdown()


async def _hold_steps(engine):
    """Make the step thread wait inside its next step until the returned event is set."""
    import threading

    release, inside = threading.Event(), threading.Event()
    step = engine.engine.step

    def held_step():
        inside.set()
        release.wait(10)
        return step()

    engine.engine.step = held_step
    return release, inside


async def test_a_caller_that_gives_up_while_its_request_is_queued_leaves_the_engine_running(engine):
    """The client leaves while its request waits for the step thread (busy in a step): its add and abort
    commands both find it gone, and the thread goes on serving everyone else."""
    release, inside = await _hold_steps(engine)
    busy = asyncio.create_task(_collect(engine, "Hello world", "busy"))
    while not inside.is_set():
        await asyncio.sleep(0.01)
    leaver = asyncio.create_task(_collect(engine, "The quick brown fox", "leaver"))
    await asyncio.sleep(0.05)  # its add command is queued and it waits on the step thread's answer
    leaver.cancel()
    abort = asyncio.create_task(engine.abort("leaver"))
    await asyncio.sleep(0.05)
    abort.cancel()  # a caller that gives up on its abort, too
    release.set()
    assert (await asyncio.wait_for(busy, 30))[-1].finished
    later = await asyncio.wait_for(_collect(engine, "Hello", "later"), 30)
    assert later[-1].finished and engine.failure is None and engine.available
    assert engine._thread.is_alive() and engine.stats().kv_blocks_used == 0


async def test_a_step_thread_that_stops_fails_requests_and_turns_unavailable(engine):
    """Whatever kills the step thread, waiting requests get an error instead of hanging, new ones are
    refused at once, and `available` (readiness) turns false."""
    from loraplex.engine.errors import EngineError

    release, inside = await _hold_steps(engine)
    waiting = asyncio.create_task(_collect(engine, "Hello world", "waiting"))
    while not inside.is_set():
        await asyncio.sleep(0.01)

    def broken():
        raise SystemError("a defect outside any one step")

    engine.engine.has_unfinished_requests = broken
    release.set()
    with pytest.raises(EngineError, match="engine stopped"):
        await asyncio.wait_for(waiting, 30)
    assert not engine.available and "SystemError" in engine.failure
    with pytest.raises(EngineError, match="engine stopped"):
        await _collect(engine, "Hello", "after")
    await asyncio.wait_for(engine.abort("waiting"), 5)  # answered, not left waiting on a dead thread


async def _collect(engine, prompt, request_id, params=GREEDY):
    return [out async for out in engine.generate(prompt, params, request_id)]


def _gate_steps(engine):
    """Make each step of the step thread wait for a `gate.release()`; `stepped` counts steps that ran."""
    import threading

    gate, stepped = threading.Semaphore(0), []
    step = engine.engine.step

    def gated_step():
        gate.acquire(timeout=10)
        outs = step()
        stepped.append(len(outs))
        return outs

    engine.engine.step = gated_step
    return gate, stepped


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_abort_reports_no_prompt_tokens_for_a_request_that_never_left_the_queue(tiny_llama_dir):
    """A request dropped while it waits in the queue cost the engine nothing: its abort says so."""
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=64, max_num_seqs=1))
    await eng.start()
    try:
        gate, _ = _gate_steps(eng)
        busy = asyncio.create_task(_collect(eng, "Hello world", "busy"))
        gate.release()  # the busy request's prefill: it holds the only sequence slot from now on
        queued = asyncio.create_task(_collect(eng, "The quick brown fox", "queued"))
        await _until(lambda: eng.stats().num_waiting == 1)
        queued.cancel()  # the client leaves: closing its stream aborts it
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.release()  # a decode of the busy request; the queued one is still not admitted
        assert await eng.abort("queued") == 0
        assert await eng.abort("never-sent") == 0
        for _ in range(40):
            gate.release()
        assert (await asyncio.wait_for(busy, 30))[-1].finished
    finally:
        for _ in range(40):
            gate.release()
        await eng.shutdown()


async def test_abort_reports_the_prompt_of_a_request_dropped_in_its_prefill(engine):
    """The client leaves while the step with its prefill runs: the engine finishes that step (and here the
    request, max_tokens=1) for nobody, and the abort that follows reports the whole prompt processed."""
    gate, stepped = _gate_steps(engine)
    prompt = engine.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(temperature=0, max_tokens=1, n=2)
    leaver = asyncio.create_task(_collect(engine, prompt, "leaver", params))
    await _until(lambda: "leaver" in engine.engine.requests)
    leaver.cancel()  # its stream's abort waits for the step under way
    with pytest.raises(asyncio.CancelledError):
        await leaver
    gate.release()
    assert await engine.abort("leaver") == len(prompt)  # n=2: the prompt ran once, and counts once
    assert stepped == [1] and engine.stats().kv_blocks_used == 0


async def test_abort_reports_how_far_a_chunked_prefill_ran(tiny_llama_dir):
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=64, max_num_batched_tokens=8))
    await eng.start()
    try:
        gate, stepped = _gate_steps(eng)
        prompt = list(range(5, 35))  # 30 tokens: four chunks of 8
        params = SamplingParams(temperature=0, max_tokens=4)
        leaver = asyncio.create_task(_collect(eng, prompt, "chunked", params))
        await _until(lambda: "chunked" in eng.engine.requests)
        gate.release()
        gate.release()
        await _until(lambda: len(stepped) == 2)  # two chunks ran, no token yet
        leaver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaver
        gate.release()  # the step under way when the client left (a third chunk) runs to its end
        assert await eng.abort("chunked") == 24
    finally:
        for _ in range(10):
            gate.release()
        await eng.shutdown()


async def test_an_abort_sent_as_the_engine_shuts_down_is_answered(tiny_llama_dir):
    """An abort (or a request) sent after the step thread's last look at its commands, as the server's
    shutdown ends the requests still running, is answered by the shutdown rather than left waiting for ever."""
    eng = AsyncEngine(EngineConfig(str(tiny_llama_dir), num_kv_blocks=64))
    await eng.start()
    eng._stopping = True  # the shutdown has begun: the step thread leaves its loop
    eng._wake.set()
    await asyncio.to_thread(eng._thread.join)
    abort = asyncio.create_task(eng.abort("late"))
    await asyncio.sleep(0)  # its command is queued, and it waits on the answer
    assert not abort.done()
    await eng.shutdown()
    for _ in range(3):
        await asyncio.sleep(0)
    assert abort.done() and abort.result() is None
