"""`loraplex engine`: the engine behind a small internal HTTP API, registered in Redis with a heartbeat."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from loraplex.config import Settings
from loraplex.engine.client import EngineClient
from loraplex.engine.errors import EngineError, InvalidRequestError
from loraplex.platform.outage import OutageLog
from loraplex.platform.remote.protocol import (
    SECRET_HEADER,
    adapter_from_json,
    engine_token,
    output_to_json,
    params_from_json,
    secret_fingerprint,
    stats_to_json,
)

log = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 2.0
REGISTRATION_TTL = 10
# A generate stream sends a blank line after this long without an output; an API process gives up on an
# engine that sends nothing for STREAM_READ_TIMEOUT (frozen, or cut off without the connection closing).
STREAM_HEARTBEAT_SECONDS = 5.0
STREAM_READ_TIMEOUT = 60.0
# how long the engine process waits for its step thread to confirm an abort (busy in a long step, or stopping)
# before it answers without the count; the API process waits ABORT_REQUEST_SECONDS for that answer, both well
# inside the ABORT_TIMEOUT_SECONDS a request's settlement waits for its aborts
ENGINE_ABORT_SECONDS = 5.0
ABORT_REQUEST_SECONDS = 8.0


class EngineStopped(RuntimeError):
    """The engine stopped on an error while its process served: the process exits with an error status."""


def registry_key(prefix: str, engine_id: str = "*") -> str:
    return f"{prefix}:engines:{engine_id}"


def served_name(model: str) -> str:
    """A base model's name as API and engine processes compare it: a served name or Hub id as it is, a local
    path by its folder (or file) name, since each machine may keep the model under another directory."""
    if model.startswith(("/", "./", "../", "~")) or "\\" in model:
        return model.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    return model


class _NDJSONStream(StreamingResponse):
    media_type = "application/x-ndjson"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # the API process went away: abort at once


def _pin(value) -> bool | None:
    """A prefetch's pin: true pins, false unpins, absent leaves it."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"pin must be true, false or null, got {value!r}")


def build_engine_app(settings: Settings, engine: EngineClient, *, advertise: str, redis=None,
                     engine_id: str | None = None, draining: threading.Event | None = None,
                     on_engine_failure: Callable[[], None] | None = None) -> FastAPI:
    """`draining`: set when the process is told to stop; the heartbeat then withdraws the registration at
    once, so API processes stop sending new requests while the running ones finish. `on_engine_failure`:
    called once the engine has stopped on an error and its registration is withdrawn (the process exits)."""
    engine_id = engine_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    draining = draining or threading.Event()
    running = threading.Event()  # set while the engine runs: between the lifespan's start and its shutdown
    token = engine_token(settings.secret_key)

    def check(x_loraplex_engine_token: str | None = Header(default=None, alias=SECRET_HEADER)) -> None:
        if x_loraplex_engine_token != token:
            raise HTTPException(401, "engine endpoints are internal")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from loraplex.platform.db import make_engine, make_session_factory
        from loraplex.platform.engine_worker import EngineQueueConsumer
        from loraplex.platform.pin_sync import keep_pins_in_sync
        from loraplex.platform.tasks.context import TaskContext, set_context

        await engine.start()
        running.set()
        sessions = make_session_factory(make_engine(settings.resolved_database_url))
        context = TaskContext(settings, sessions, engine, asyncio.get_running_loop())
        set_context(context)
        pins = asyncio.create_task(keep_pins_in_sync(context, settings.pin_sync_interval), name="pin-sync")
        consumer = EngineQueueConsumer(settings) if settings.redis_url else None
        if consumer:
            await asyncio.to_thread(consumer.start)
        beat = (asyncio.create_task(_heartbeat(redis, settings, engine, engine_id, advertise, draining,
                                               on_engine_failure)) if redis else None)
        try:
            yield
        finally:
            running.clear()
            pins.cancel()
            await asyncio.gather(pins, return_exceptions=True)
            if beat:
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)
                await redis.delete(registry_key(settings.redis_prefix, engine_id))
            if consumer:
                await asyncio.to_thread(consumer.stop)
            await engine.shutdown()

    # no /docs or /openapi.json: an unauthenticated listing of the internal API is no business of a caller's
    app = FastAPI(title="loraplex engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # everything but the probes is for API processes only
    internal = APIRouter(dependencies=[Depends(check)])

    # Probes for an orchestrator (Kubernetes, compose, a load balancer): no token, and nothing in them but
    # whether this process answers and whether its engine serves.
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        problem = _engine_problem(engine, running, draining)
        if problem:
            return JSONResponse({"status": "not ready", "problems": [f"engine: {problem}"]}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.exception_handler(ClientDisconnect)
    async def client_left(_request, _exc):  # the API process gave up before its request was read
        return Response(status_code=499)

    @app.exception_handler(EngineError)
    async def engine_error(_request, exc: EngineError):
        return JSONResponse({"error": type(exc).__name__, "message": str(exc),
                             "param": getattr(exc, "param", None)}, status_code=400)

    @internal.get("/engine/info")
    async def info() -> dict:
        return {"engine_id": engine_id, "model_name": engine.model_name, "max_model_len": engine.max_model_len}

    @internal.post("/engine/generate")
    async def generate(request: Request):
        body = await request.json()
        stream = engine.generate(body["prompt"], params_from_json(body["params"]), body["request_id"],
                                 adapter=adapter_from_json(body.get("adapter")), tenant=body.get("tenant"))
        # The outputs are read by a task of their own into a queue, so that the response can send a blank
        # line while none comes (a long queue or prefill): the API process then tells a busy engine from a
        # frozen one by its read timeout (STREAM_READ_TIMEOUT) rather than waiting for ever.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in stream:
                    await queue.put(("output", out))
                await queue.put(("end", None))
            except Exception as exc:
                await queue.put(("error", exc))

        task = asyncio.create_task(pump())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()

        try:  # a request the engine refuses or fails at once is still an error answer (400, 500), not a stream
            first = await asyncio.wait_for(queue.get(), timeout=STREAM_HEARTBEAT_SECONDS)
        except TimeoutError:
            first = None
        if first is not None and first[0] == "error":
            await stop()
            raise first[1]

        async def lines():
            item = first
            try:
                while True:
                    if item is None:
                        try:
                            item = await asyncio.wait_for(queue.get(), timeout=STREAM_HEARTBEAT_SECONDS)
                        except TimeoutError:
                            yield b"\n"  # still working on it
                            continue
                    kind, value = item
                    item = None
                    if kind == "end":
                        return
                    if kind == "error":
                        if isinstance(value, InvalidRequestError):
                            yield json.dumps({"invalid_request": str(value),
                                              "param": getattr(value, "param", None)}).encode() + b"\n"
                            return
                        raise value
                    yield json.dumps(output_to_json(value)).encode() + b"\n"
            finally:
                await stop()

        return _NDJSONStream(lines())

    @internal.post("/engine/abort")
    async def abort(body: dict) -> dict:
        # the API process bills a dropped request for the prompt tokens this engine processed; one of an
        # older version, which reads only "ok", bills as it did
        try:
            processed = await asyncio.wait_for(engine.abort(body["request_id"]), ENGINE_ABORT_SECONDS)
        except TimeoutError:
            log.warning("abort of request %s: the engine did not confirm it within ENGINE_ABORT_SECONDS=%g s; "
                        "answered without its prompt count", body["request_id"], ENGINE_ABORT_SECONDS)
            processed = None
        return {"ok": True, "prompt_tokens_processed": processed}

    @internal.post("/engine/prefetch")
    async def prefetch(body: dict) -> dict:
        await engine.prefetch_adapter(adapter_from_json(body["adapter"]), pin=_pin(body.get("pin")))
        return {"ok": True}

    @internal.post("/engine/unpin")
    async def unpin(body: dict) -> dict:
        content_hash = body.get("content_hash")
        if not isinstance(content_hash, str) or not content_hash:
            raise HTTPException(422, "content_hash must be a non-empty string")
        await engine.unpin_adapter(content_hash)
        return {"ok": True}

    @internal.post("/engine/remove")
    async def remove(body: dict) -> dict:
        await engine.remove_adapter(body["content_hash"])
        return {"ok": True}

    @internal.get("/engine/stats")
    async def stats() -> dict:
        return asdict(engine.stats())

    app.include_router(internal)
    return app


def _engine_problem(engine: EngineClient, running: threading.Event, draining: threading.Event) -> str | None:
    """Why this engine process would serve no new request now, or None when it would."""
    failure = getattr(engine, "failure", None)
    if failure:
        return f"the engine stopped: {failure}"
    if draining.is_set():
        return "the process is stopping: it takes no new requests"
    if not running.is_set():
        return "the engine is not running yet"
    return None


DRAIN_POLL_SECONDS = 0.1


async def _heartbeat(redis, settings: Settings, engine: EngineClient, engine_id: str, advertise: str,
                     draining: threading.Event | None = None,
                     on_engine_failure: Callable[[], None] | None = None) -> None:
    key = registry_key(settings.redis_prefix, engine_id)
    outage = OutageLog(log, "engine heartbeat", HEARTBEAT_SECONDS,
                       ", API processes cannot find this engine until it is restored")
    while True:
        failure = getattr(engine, "failure", None)
        if failure or (draining is not None and draining.is_set()):
            why = f"the engine stopped ({failure})" if failure else "draining"
            try:
                await redis.delete(key)
                log.log(logging.ERROR if failure else logging.INFO,
                        "%s: registration withdrawn, API processes send it no more requests", why)
            except Exception as exc:  # it lapses after REGISTRATION_TTL anyway
                log.warning("%s: could not withdraw the registration: %s", why, exc)
            if failure and on_engine_failure is not None:
                on_engine_failure()
            return
        try:
            s = engine.stats()
            record = {"engine_id": engine_id, "url": advertise, "model_name": engine.model_name,
                      # the name clients use for its base model: API processes route only to engines serving theirs
                      "served_model_name": served_name(settings.served_model_name or engine.model_name),
                      # API processes with another secret would have every request refused: they skip it
                      "secret_fingerprint": secret_fingerprint(settings.secret_key),
                      "max_model_len": engine.max_model_len, "running": s.num_running, "waiting": s.num_waiting,
                      "max_num_seqs": settings.max_num_seqs, "resident": list(s.lora_resident),
                      "host_cached": list(s.lora_host_cached), "updated": time.time(),
                      # the rest of the snapshot, for the API processes' /metrics and console
                      "stats": stats_to_json(s)}
            await redis.set(key, json.dumps(record), ex=REGISTRATION_TTL)
            outage.ok()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outage.failed(exc)
        deadline = time.monotonic() + HEARTBEAT_SECONDS
        while True:  # the next beat, or sooner when the drain begins
            await asyncio.sleep(min(DRAIN_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline or (draining is not None and draining.is_set()):
                break


def run_engine_server(settings: Settings, *, host: str, port: int, advertise: str | None = None,
                      listener: socket.socket | None = None) -> None:
    """`listener`: a socket already listening on host:port, which the server then serves on (its port is the
    one advertised, so that `--port 0` advertises the port the system chose)."""
    import uvicorn

    from loraplex.platform.engine_factory import build_engine

    if listener is not None:
        port = listener.getsockname()[1]
    if advertise is None:
        # a wildcard address is no address to reach: advertise the host's name (a container's service name)
        reachable = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        advertise = f"http://{reachable}:{port}"
    engine = build_engine(settings)
    from loraplex.platform.redis_clients import async_redis

    redis = async_redis(settings)
    draining = threading.Event()
    servers: list[uvicorn.Server] = []

    def exit_on_engine_failure() -> None:
        # a process that stays up with a dead engine serves nothing and is restarted by nobody: it exits, with
        # an error status, so that its supervisor (compose's `restart: on-failure`, systemd, Kubernetes) starts
        # a fresh one
        log.critical("the engine stopped; this engine process exits so that its supervisor starts a new one")
        for running in servers:
            running.should_exit = True

    app = build_engine_app(settings, engine, advertise=advertise, redis=redis, draining=draining,
                           on_engine_failure=exit_on_engine_failure)

    from loraplex.platform.stopping import SignalStopServer

    class Server(SignalStopServer):
        def handle_exit(self, sig, frame) -> None:
            draining.set()  # SIGTERM / Ctrl-C: leave the registry first, then drain
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if sockets is not None and not self.should_exit:  # uvicorn says where it listens only on its own bind
                self._log_started_message(sockets)

    from loraplex.platform.http_protocol import http_protocol_class

    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            http=http_protocol_class(), timeout_keep_alive=settings.keep_alive_timeout,
                            timeout_graceful_shutdown=settings.shutdown_timeout)
    servers.append(Server(config))
    servers[0].run(sockets=[listener] if listener is not None else None)
    failure = getattr(engine, "failure", None)
    if failure:
        raise EngineStopped(f"the engine stopped: {failure}")
