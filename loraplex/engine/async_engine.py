"""`AsyncEngine`: the engine's step loop on a background thread, one async stream per request.

The event loop never runs model code: requests and aborts are handed to the step thread through a
command queue, and each step's outputs are handed back to the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from loraplex.engine.client import EngineStats
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineError, EngineOverloadedError, InvalidRequestError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import fit_max_tokens

log = logging.getLogger(__name__)
IDLE_STEP_WAIT_S = 0.005  # how long the loop waits after a step in which nothing could run
# how many ended requests' prompt progress the engine keeps for `abort` to report (their callers ask at once)
ENDED_KEPT = 4096


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, adapter_slots: Any = None, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine(config, adapter_slots=adapter_slots)
        self.model_name = config.model
        self.max_model_len = self.engine.limits.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_aborted = 0
        # request id -> prompt tokens processed, for requests that ended (finished, aborted, failed) and were
        # not yet asked about by `abort`; only the step thread reads and writes it
        self._ended: OrderedDict[str, int] = OrderedDict()
        self.failure: str | None = None  # why the step thread stopped, if it stopped on an error

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self.failure = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        # commands sent after the step thread's last look at its queue (an abort of a request the shutdown
        # ends, a late add) would wait for an answer for ever: answered here, as a stopped engine answers them
        self._refuse_commands()
        for request_id, stream in list(self._streams.items()):
            stream.put(EngineOverloadedError("the engine is shutting down"))
            self._streams.pop(request_id, None)

    # -- requests ---------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        adapter: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.failure is not None:
            raise EngineError(f"the engine stopped: {self.failure}")
        if self._thread is None or self._stopping:
            raise EngineOverloadedError("the engine is not running")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if len(self._streams) >= self.config.max_queue_len:
            raise EngineOverloadedError("too many requests are queued; try again later")
        # Validate here, so a bad request fails in the caller before anything is streamed.
        _, ids = self.engine.encode_prompt(prompt)
        params = fit_max_tokens(self.engine.scheduler, len(ids), params)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        added: Future = Future()
        self._send(("add", request_id, ids, params, adapter, tenant, added))
        finished = False
        try:
            await asyncio.wrap_future(added)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id, None))

    @property
    def available(self) -> bool:
        """False once the step thread has stopped on an error: nothing would be served."""
        return self.failure is None

    async def abort(self, request_id: str) -> int | None:
        """End the request if it still runs, and say how many of its prompt tokens the engine processed:
        0 for one that never left the queue (or that this engine never had), some or all of them for one
        dropped in its (chunked) prefill, all of them once it generated. A request whose stream was closed
        first (a client that left) was aborted by that close: its count is kept for this call. None when the
        step thread is not running to tell."""
        done: Future = Future()
        self._send(("abort", request_id, done))
        if self._thread is None:
            return None
        return await asyncio.wrap_future(done)

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, max_model_len=self.max_model_len)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                         max_model_len=self.max_model_len)

    async def prefetch_adapter(self, adapter: LoRARequest, *, pin: bool | None = None) -> None:
        slots = self.engine.adapter_slots
        if slots is None or not hasattr(slots, "prefetch"):
            raise InvalidRequestError("this engine was started without adapter support", param="adapter")
        await asyncio.wrap_future(slots.prefetch(adapter, pin=pin))

    async def unpin_adapter(self, content_hash: str) -> None:
        """Let a pinned adapter be evicted again (it stays where it is until then); nothing is loaded."""
        slots = self.engine.adapter_slots
        if slots is not None and hasattr(slots, "unpin"):
            slots.unpin(content_hash)

    def pinned_adapters(self) -> set[str] | None:
        """Content hashes pinned in this engine; None when it was started without adapter support."""
        slots = self.engine.adapter_slots
        stats = getattr(slots, "stats", None)
        return set(stats().get("lora_pinned", ())) if callable(stats) else None

    async def remove_adapter(self, content_hash: str) -> None:
        """Drop the adapter from the cache: at once when no request uses it, otherwise when the last running
        request that uses it stops. Returns at once either way: a delete does not wait for those requests
        (a long stream would hold the DELETE that removed its adapter for as long as it runs)."""
        slots = self.engine.adapter_slots
        if slots is None or not hasattr(slots, "remove"):
            return
        slots.remove(content_hash)

    def stats(self) -> EngineStats:
        eng = self.engine
        bm = eng.block_manager
        stats = EngineStats(
            num_running=len(eng.scheduler.running),
            num_waiting=eng.scheduler.num_waiting,
            num_preempted_total=eng.scheduler.num_preemptions,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            prompt_tokens_total=eng.prompt_tokens_total,
            generation_tokens_total=eng.generation_tokens_total,
        )
        lora_stats = getattr(eng.adapter_slots, "stats", None)
        if callable(lora_stats):
            for key, value in lora_stats().items():
                if hasattr(stats, key):
                    setattr(stats, key, value)
                else:
                    stats.extra[key] = value
        stats.extra["num_aborted_total"] = self._num_aborted
        return stats

    # -- the step thread --------------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()
        if self.failure is not None:  # no step thread will take it: answer it here
            self._refuse_commands()

    def _queued_commands(self):
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._queued_commands():
            try:
                self._run_command(command)
            except Exception as exc:  # one command's failure must not stop the step thread
                log.exception("engine command %r failed", command[:2])
                future = command[-1]
                if future is not None and not future.done():
                    with contextlib.suppress(InvalidStateError):  # its caller gave up meanwhile
                        future.set_exception(exc)

    def _run_command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, ids, params, adapter, tenant, added = command
            # The caller gave up (a client that left while its request waited here) and cancelled the future:
            # nothing is added, and its abort, which follows, finds nothing to do.
            if not added.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(request_id, ids, params, lora=adapter, tenant=tenant)
            except Exception as exc:  # the request is refused; the engine goes on
                added.set_exception(exc)
            else:
                added.set_result(None)
        elif kind == "abort":
            _, request_id, done = command
            if done is not None and not done.set_running_or_notify_cancel():
                done = None
            try:
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._num_aborted += 1
                    self._note_ended(out)
            finally:
                if done is not None:
                    done.set_result(self._ended.pop(request_id, 0))

    def _note_ended(self, out: RequestOutput) -> None:
        """Keep an ended request's prompt progress for `abort` (its caller may have left before the last
        output, or closed the stream, which aborts it, before asking)."""
        self._ended[out.request_id] = out.num_prompt_tokens_processed
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def _refuse_commands(self) -> None:
        """Answer every queued command of a stopped engine: requests fail, aborts are done."""
        for command in self._queued_commands():
            future = command[-1]
            if future is None or not future.set_running_or_notify_cancel():
                continue
            if command[0] == "add":
                future.set_exception(EngineError(f"the engine stopped: {self.failure}") if self.failure
                                     else EngineOverloadedError("the engine is shutting down"))
            else:
                future.set_result(None)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # Whatever stopped the step thread: say so (readiness turns false) and fail what waits on it,
            # rather than leave every request hanging on a server that still looks ready.
            log.critical("the engine's step thread stopped; no request can be served", exc_info=True)
            self.failure = f"{type(exc).__name__} in its step thread (the server log has the cause)"
            self._refuse_commands()
            for request_id, stream in list(self._streams.items()):
                stream.put(EngineError(f"the engine stopped: {self.failure}"))
                self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not take the server down silently
                log.exception("engine step failed; failing the requests in flight")
                for request_id in list(self.engine.requests):
                    self._note_ended(self.engine.abort_request(request_id))
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(RuntimeError(f"engine step failed: {exc!r}"))
                continue
            for out in outputs:
                if out.finished:
                    self._note_ended(out)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
            if not outputs and self.engine.last_step_idle:
                # nothing could run (requests waiting on something outside the step): wait for a command
                # (a new request, an abort) or a few milliseconds rather than spin on an idle step
                self._wake.wait(timeout=IDLE_STEP_WAIT_S)
                self._wake.clear()
        # Leave no request half-done: free every block on the way out.
        self._drain_commands()
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
