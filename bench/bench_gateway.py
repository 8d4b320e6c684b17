"""The gateway's own cost: latency that auth, quota, routing and the OpenAI layer add to an engine call.

Both paths run in one process on the same engine, interleaved request by request:
  engine   encode_chat + AsyncEngine.generate (1 token, greedy) called directly
  gateway  the same chat completion through the whole FastAPI app (httpx over ASGI: request id, API-key
           lookup, scope check, model resolution, quota reserve/settle, usage journal, JSON)
A second pair uses a zero-cost engine, so the gateway row is the gateway's cost alone. With --http the
app also runs under uvicorn on a loopback port for an end-to-end row (socket and HTTP parsing included).

    python bench/bench_gateway.py [--requests 2000] [--adapter] [--http]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "platform"))

# As `loraplex serve` does, before torch is imported: idle OpenMP workers sleep instead of spinning. To
# measure torch's default policy instead, set it in the environment (GOMP_SPINCOUNT=300000).
from loraplex.platform.cpu_threads import prefer_passive_openmp  # noqa: E402

prefer_passive_openmp()

MESSAGES = [{"role": "user", "content": "Hello there, how are you today?"}]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_pair(app, engine, key: str, model: str, adapter, n: int, warmup: int, tenant: str = "1"):
    from loraplex.engine.sampling_params import SamplingParams

    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    direct, gateway = [], []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            ids = engine.encode_chat(MESSAGES)
            async for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0), f"direct-{i}",
                                           adapter=adapter, tenant=tenant):
                pass
            t1 = time.perf_counter()
            r = await client.post("/v1/chat/completions", headers=headers, json=body)
            t2 = time.perf_counter()
            if r.status_code != 200:
                raise SystemExit(f"gateway request failed: {r.status_code} {r.text}")
            if i >= warmup:
                direct.append((t1 - t0) * 1000)
                gateway.append((t2 - t1) * 1000)
    return direct, gateway


async def run_over_http(app, key: str, model: str, n: int, warmup: int) -> list[float]:
    """uvicorn on the app's own loop (as `loraplex serve` runs it); the client shares that loop, so this
    row also carries the client's own cost."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        return await run_http(f"http://127.0.0.1:{port}", key, model, n, warmup)
    finally:
        server.should_exit = True
        await task


async def run_http(url: str, key: str, model: str, n: int, warmup: int) -> list[float]:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    out = []
    async with httpx.AsyncClient(base_url=url) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", headers=headers, json=body)
            r.raise_for_status()
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1000)
    return out


def build(tmp: Path, model_dir: Path, engine, name: str):
    from platform_helpers import make_settings

    from loraplex.platform.app import create_app
    from loraplex.platform.bootstrap import prepare_database
    from loraplex.platform.db import session_scope
    from loraplex.platform.schemas.tenants import KeyCreate, TenantCreate
    from loraplex.platform.tenants import create_api_key, create_tenant

    data = tmp / name
    data.mkdir(exist_ok=True)
    settings = make_settings(data, model=str(model_dir), served_model_name="tiny-base",
                             default_requests_per_minute=10**9, default_tokens_per_minute=10**12,
                             usage_flush_interval=0.5)
    prepare_database(settings)
    app = create_app(settings, engine=engine)
    with session_scope(app.state.services.sessions) as session:
        tenant = create_tenant(session, TenantCreate(name="bench"))
        key = create_api_key(session, settings, tenant, KeyCreate()).key
    return app, key


async def upload_adapter(app, key: str, model_dir: Path, tmp: Path):
    import zipfile

    from loraplex.testing import make_peft_adapter

    adapter_dir = make_peft_adapter(model_dir, tmp / "adapter", r=8, target_modules=("q_proj", "v_proj"))
    archive = tmp / "adapter.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in adapter_dir.iterdir():
            zf.write(f, f.name)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        r = await client.post("/v1/adapters", params={"wait": "true"}, headers={"Authorization": f"Bearer {key}"},
                              data={"name": "bench"}, files={"file": ("a.zip", archive.read_bytes())})
        r.raise_for_status()
    from loraplex.platform.registry import resolve_model

    services = app.state.services
    with services.sessions() as session:
        target = resolve_model(session, 1, "bench", "tiny-base", services.settings.resolved_adapter_store_dir.resolve())
    return target.adapter


async def main(args) -> None:
    from fake_engine import FakeEngine

    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.testing import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    try:
        model_dir = make_tiny_model(tmp / "model", "llama")
        rows = []

        real = AsyncEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, max_model_len=256,
                                        adapter_store=str(tmp / "real" / "adapters")))  # the app's store
        await real.start()
        app, key = build(tmp, model_dir, real, "real")
        async with app.router.lifespan_context(app):
            model, adapter = "tiny-base", None
            if args.adapter:
                adapter = await upload_adapter(app, key, model_dir, tmp)
                model = "bench"
            direct, gateway = await run_pair(app, real, key, model, adapter, args.requests, args.warmup)
            rows.append(("tiny llama, real engine" + (", adapter" if adapter else ""), direct, gateway))
            if args.http:
                http = await run_over_http(app, key, model, args.requests, args.warmup)
                rows.append(("  same, uvicorn + httpx over loopback", direct, http))
        await real.shutdown()

        fake = FakeEngine(model_name="tiny-base")
        app, key = build(tmp, model_dir, fake, "fake")
        async with app.router.lifespan_context(app):
            direct, gateway = await run_pair(app, fake, key, "tiny-base", None, args.requests, args.warmup)
            rows.append(("zero-cost engine (gateway alone)", direct, gateway))

        print(f"\nGateway overhead, {args.requests} sequential chat completions (1 token), ms\n")
        print(f"| {'setup':<40} | engine p50 | engine p99 | gateway p50 | gateway p99 | added p50 | added p99 |")
        print(f"|{'-' * 42}|-----------:|-----------:|------------:|------------:|----------:|----------:|")
        for name, direct, gateway in rows:
            d50, d99, g50, g99 = pct(direct, .5), pct(direct, .99), pct(gateway, .5), pct(gateway, .99)
            print(f"| {name:<40} | {d50:10.3f} | {d99:10.3f} | {g50:11.3f} | {g99:11.3f} | "
                  f"{g50 - d50:9.3f} | {g99 - d99:9.3f} |")
        print(f"\nmean engine {statistics.mean(rows[0][1]):.3f} ms; target: added p50 < 2 ms, added p99 < 5 ms")
        policy = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS") if k in os.environ}
        print(f"OpenMP: {policy or 'torch defaults'}; load average {os.getloadavg()[0]:.2f} at the end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--adapter", action="store_true", help="route every request to an uploaded adapter")
    parser.add_argument("--http", action="store_true", help="also measure over loopback HTTP (uvicorn)")
    asyncio.run(main(parser.parse_args()))
