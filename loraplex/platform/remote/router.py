"""EngineRouter: one EngineClient over every registered engine process.

A request goes to an engine that already holds its adapter (device slot first, then host cache) unless that
engine is overloaded; otherwise to the least loaded engine. Registrations come from Redis and are refreshed
in the background, so choosing costs no round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraplex.config import Settings
from loraplex.engine.client import EngineStats
from loraplex.engine.errors import EngineOverloadedError, EngineUnreachableError
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.outage import OutageLog, every
from loraplex.platform.remote.client import RemoteEngine
from loraplex.platform.remote.protocol import add_stats, secret_fingerprint
from loraplex.platform.remote.server import REGISTRATION_TTL, registry_key, served_name

log = logging.getLogger(__name__)
REFRESH_SECONDS = 1.0
ENDED_KEPT = 4096  # ended requests whose engine `abort` can still ask (their callers ask at once)
OVERLOAD_FACTOR = 2.0  # queued work above this multiple of max_num_seqs counts as overloaded
PIN_FANOUT_WAIT_S = 2.0  # how long a pin or unpin waits for every engine before the rest go on behind it


class EngineRouter:
    def __init__(self, settings: Settings, redis, tokenizer, *, max_model_len: int | None = None):
        self.settings = settings
        self.redis = redis
        self.tokenizer = tokenizer
        self.model_name = settings.served_model_name or settings.model
        self.max_model_len = max_model_len or 0
        self.engines: dict[str, RemoteEngine] = {}
        self.records: dict[str, dict] = {}
        # registered engines that serve another base model (a process started with another LORAPLEX_MODEL, or
        # left from before a model change): never routed to, as this process tokenizes for its own model and
        # answers in its name -> the model they serve
        self.foreign: dict[str, str] = {}
        # registered engines started with another LORAPLEX_SECRET_KEY: they would refuse every request this
        # process sends (401), so none is sent -> their URL
        self.other_secret: dict[str, str] = {}
        self._fingerprint = secret_fingerprint(settings.secret_key)
        self._refresher: asyncio.Task | None = None
        self._owner: dict[str, RemoteEngine] = {}  # request id -> engine serving it
        self._ended: OrderedDict[str, RemoteEngine] = OrderedDict()  # request id -> engine that served it
        # engines found unreachable, passed over until this time (monotonic) unless nothing else is left:
        # their registrations live on in Redis for up to REGISTRATION_TTL after they die
        self._down: dict[str, float] = {}
        self._down_at: dict[str, float] = {}  # when it was found unreachable (wall clock, as heartbeats are)
        self._fanout: set[asyncio.Task] = set()  # pin changes still on their way to slow engines

    @property
    def available(self) -> bool:
        """Whether some registered engine can be tried: one found unreachable does not count until its
        registration lapses or a heartbeat newer than the failure shows it alive."""
        now = time.monotonic()
        return any(self._down.get(e, 0.0) <= now for e in self.records)

    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="engine-registry")

    async def shutdown(self) -> None:
        if self._refresher:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        for task in list(self._fanout):  # the engines take these from the database at their next pin sync
            task.cancel()
        await asyncio.gather(*self._fanout, return_exceptions=True)
        for engine in self.engines.values():
            await engine.shutdown()

    async def _refresh_loop(self) -> None:
        # the engines known from the last reading keep serving while Redis is away
        await every(REFRESH_SECONDS, self.refresh, OutageLog(log, "reading the engine registry", REFRESH_SECONDS))

    @property
    def unavailable_reason(self) -> str | None:
        """Why no engine serves, where registered engines all serve another base model; else None."""
        if self.records or not (self.foreign or self.other_secret):
            return None
        if self.other_secret and not self.foreign:
            # the log names them; this line also reaches tenants
            return ("No engine process accepts this API process's LORAPLEX_SECRET_KEY (the registered ones were "
                    "started with another one).")
        return (f"No engine process serves the model {served_name(self.model_name)!r} (the registered ones serve "
                f"{', '.join(sorted(set(self.foreign.values())))}).")

    def serves_our_model(self, rec: dict) -> bool:
        """Whether a registration's engine serves this process's base model (an engine of an older version,
        whose record names only its model, by that)."""
        return (rec.get("served_model_name") or served_name(str(rec.get("model_name", "")))) == served_name(
            self.model_name)

    async def refresh(self) -> None:
        keys = [k async for k in self.redis.scan_iter(registry_key(self.settings.redis_prefix))]
        values = await self.redis.mget(keys) if keys else []
        records, foreign, other_secret = {}, {}, {}
        for raw in values:
            if not raw:
                continue
            rec = json.loads(raw)
            if time.time() - rec.get("updated", 0) > REGISTRATION_TTL:
                continue
            # an engine of an older version does not say: it is tried, and a refusal is logged per request
            if rec.get("secret_fingerprint", self._fingerprint) != self._fingerprint:
                other_secret[rec["engine_id"]] = str(rec.get("url"))
                if rec["engine_id"] not in self.other_secret:
                    log.warning("engine %s at %s was started with another LORAPLEX_SECRET_KEY than this API "
                                "process: it would refuse every request, so none is sent to it (give every "
                                "process the same LORAPLEX_SECRET_KEY)", rec["engine_id"], rec.get("url"))
                continue
            if self.serves_our_model(rec):
                records[rec["engine_id"]] = rec
                continue
            theirs = rec.get("served_model_name") or served_name(str(rec.get("model_name", "")))
            foreign[rec["engine_id"]] = theirs
            if rec["engine_id"] not in self.foreign:
                log.warning("engine %s at %s serves the model %r, not this API process's %r: no request is sent "
                            "to it (give every process the same LORAPLEX_MODEL, or LORAPLEX_SERVED_MODEL_NAME)",
                            rec["engine_id"], rec.get("url"), theirs, served_name(self.model_name))
        self.foreign = foreign
        self.other_secret = other_secret
        for engine_id, rec in records.items():
            if engine_id in self._down_at and rec.get("updated", 0.0) > self._down_at[engine_id]:
                self._down.pop(engine_id, None)  # it beat since it failed us: alive again
                self._down_at.pop(engine_id, None)
            if engine_id not in self.engines:
                self.engines[engine_id] = RemoteEngine(rec["url"], self.settings.secret_key,
                                                       model_name=rec["model_name"],
                                                       max_model_len=rec["max_model_len"], tokenizer=self.tokenizer)
            self.max_model_len = self.max_model_len or rec["max_model_len"]
        for engine_id in set(self.engines) - set(records):
            self._down.pop(engine_id, None)
            self._down_at.pop(engine_id, None)
            engine = self.engines.pop(engine_id)
            if not engine.inflight:
                await engine.shutdown()
        self.records = records

    def choose(self, adapter: LoRARequest | None, exclude: frozenset[str] = frozenset()) -> RemoteEngine:
        if not self.records:
            raise EngineOverloadedError("no engine process is registered; start `loraplex engine`")
        return self.engines[self._choose_id(adapter, exclude)]

    def _choose_id(self, adapter: LoRARequest | None, exclude: frozenset[str] = frozenset()) -> str:
        """The engine for a request: not one in `exclude` (tried already for it), and one recently found
        unreachable only when no other is left."""
        now = time.monotonic()
        registered = [e for e in self.records if e in self.engines and e not in exclude]
        if not registered:
            raise EngineOverloadedError("no engine process could be reached")
        candidates = [e for e in registered if self._down.get(e, 0.0) <= now] or registered

        def load(engine_id: str) -> float:
            rec = self.records[engine_id]
            return max(rec["running"] + rec["waiting"], self.engines[engine_id].inflight)

        def overloaded(engine_id: str) -> bool:
            return load(engine_id) >= OVERLOAD_FACTOR * self.records[engine_id].get("max_num_seqs", 64)

        if adapter is not None:
            for where in ("resident", "host_cached"):
                holding = [e for e in candidates if adapter.content_hash in self.records[e].get(where, ())
                           and not overloaded(e)]
                if holding:
                    return min(holding, key=load)
        return min(candidates, key=load)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       adapter: LoRARequest | None = None, tenant: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request on the engine `choose` picks; if that engine cannot be reached, or goes away before the
        first output (killed, or shutting down), on the next one, until every registered engine was tried."""
        tried: set[str] = set()
        while True:
            if not self.records:
                raise EngineOverloadedError("no engine process is registered; start `loraplex engine`")
            engine_id = self._choose_id(adapter, frozenset(tried))
            engine = self.engines[engine_id]
            self._owner[request_id] = engine
            try:
                async for out in engine.generate(prompt, params, request_id, adapter=adapter, tenant=tenant):
                    yield out
                return
            except EngineUnreachableError as exc:
                tried.add(engine_id)
                self._down[engine_id] = time.monotonic() + REGISTRATION_TTL
                self._down_at[engine_id] = time.time()
                log.warning("request %s: %s; trying another engine", request_id, exc)
                if not [e for e in self.records if e in self.engines and e not in tried]:
                    raise
            finally:
                self._owner.pop(request_id, None)
                self._ended[request_id] = engine
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)

    async def abort(self, request_id: str) -> int | None:
        """Abort it on the engine that has it; a request whose stream ended (the client left and its stream was
        closed first) is still asked about there, for the prompt tokens that engine processed."""
        engine = self._owner.get(request_id) or self._ended.pop(request_id, None)
        if engine is None:
            return 0  # no engine was sent it
        return await engine.abort(request_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, max_model_len=self.max_model_len)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  max_model_len=self.max_model_len)

    async def prefetch_adapter(self, adapter: LoRARequest, *, pin: bool | None = None) -> None:
        """Warm the adapter on the engine `choose` picks. A pin goes to every registered engine (it keeps the
        adapter resident wherever requests for it land); an unpin too, loading nothing on the engines other
        than the chosen one (their registrations, a heartbeat old, cannot tell which hold the pin). An engine
        that cannot be reached now takes the change from the database later (`sync_pins`)."""
        if pin is None:
            await self.choose(adapter).prefetch_adapter(adapter, pin=pin)
            return
        chosen = self._choose_id(adapter)
        others = [e for e in self.records if e != chosen and e in self.engines]
        what = "pinning" if pin else "unpinning"

        def report(task: asyncio.Task) -> None:
            self._fanout.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("%s adapter %s on an engine failed: %s", what, adapter.content_hash[:12],
                            task.exception())

        tasks = [asyncio.ensure_future(self.engines[chosen].prefetch_adapter(adapter, pin=pin))]
        tasks += [asyncio.ensure_future(self.engines[e].unpin_adapter(adapter.content_hash) if pin is False
                                        else self.engines[e].prefetch_adapter(adapter, pin=pin)) for e in others]
        for task in tasks:
            self._fanout.add(task)
            task.add_done_callback(report)
        # An engine that does not answer (hung, or slow to load) does not hold the operator's call: after
        # PIN_FANOUT_WAIT_S its change goes on in the background, and the pin sync covers it if it fails.
        done, pending = await asyncio.wait(tasks, timeout=PIN_FANOUT_WAIT_S)
        failures = [t.exception() for t in done if t.exception() is not None]
        if failures and not pending and len(failures) == len(tasks):
            raise failures[0]

    async def remove_adapter(self, content_hash: str) -> None:
        await asyncio.gather(*(e.remove_adapter(content_hash) for e in self.engines.values()),
                             return_exceptions=True)

    def stats(self) -> EngineStats:
        total = EngineStats()
        for rec in self.records.values():
            _add_record(total, rec)
        total.extra["engines"] = len(self.records)
        return total

    def stats_by_engine(self) -> dict[str, EngineStats]:
        """Each registered engine's own stats, by its id (for /metrics: a sum would drop when one leaves)."""
        per_engine = {}
        for engine_id, rec in self.records.items():
            per_engine[engine_id] = EngineStats()
            _add_record(per_engine[engine_id], rec)
        return per_engine


def _add_record(total: EngineStats, rec: dict) -> None:
    if isinstance(rec.get("stats"), dict):
        add_stats(total, rec["stats"])
        return
    # a registration from an engine that publishes no full snapshot
    total.num_running += rec["running"]
    total.num_waiting += rec["waiting"]
    total.lora_resident.extend(rec.get("resident", ()))
    total.lora_host_cached.extend(rec.get("host_cached", ()))


def build_router(settings: Settings, redis) -> EngineRouter:
    from loraplex.engine.model_loader import resolve_model_dir
    from loraplex.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(settings.model))
    return EngineRouter(settings, redis, tokenizer, max_model_len=settings.max_model_len)
