"""API processes without an engine (`serve --no-engine`) reaching `loraplex engine` processes via Redis."""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")  # as test_platform_stack


@pytest.fixture
def remote_stack(tmp_path, tiny_llama_dir):
    import redis.asyncio as aioredis
    from fake_engine import FakeEngine
    from live_server import free_port, live_server

    from loraplex.config import Settings
    from loraplex.platform.app import create_app
    from loraplex.platform.bootstrap import ensure_admin_key, prepare_database
    from loraplex.platform.remote.server import build_engine_app

    prefix = f"lpxit-remote-{uuid.uuid4().hex[:8]}"
    settings = Settings(environment="test", secret_key="remote-secret-0123456789", data_dir=tmp_path,
                        model=str(tiny_llama_dir), served_model_name="tiny-base", redis_url=REDIS_URL,
                        redis_prefix=prefix, embedded_engine=False, task_queue=f"{prefix}-tasks",
                        engine_queue=f"{prefix}-engine", warm_adapters_interval=0)
    prepare_database(settings)
    engine = FakeEngine(model_name="tiny-base", token_delay=0.01)
    port = free_port()
    engine_app = build_engine_app(settings, engine, advertise=f"http://127.0.0.1:{port}",
                                  redis=aioredis.from_url(REDIS_URL), engine_id="e1")
    with live_server(engine_app, port=port):
        admin_key = ensure_admin_key(settings)
        app = create_app(settings)
        with live_server(app) as api_url:
            admin = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
            t = admin.post("/admin/api/tenants", json={"name": "remote"}).json()
            key = admin.post(f"/admin/api/tenants/{t['id']}/keys", json={}).json()["key"]
            yield api_url, key, engine
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for k in client.scan_iter(f"*{prefix}*"):  # our keys and kombu's queue bindings
        client.delete(k)
    shutil.rmtree(tmp_path / "uploads", ignore_errors=True)


def test_api_without_engine_routes_to_engine_process(remote_stack):
    api_url, key, engine = remote_stack
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the API reads the registry once a second
        try:
            out = client.completions.create(model="tiny-base", prompt="hello", max_tokens=5, logprobs=1)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            time.sleep(0.2)
    assert out.usage.completion_tokens == 5 and len(out.choices[0].logprobs.tokens) == 5
    assert engine.requests[-1]["prompt_ids"]  # tokenized in the API process, generated in the engine's
    chunks = list(client.chat.completions.create(model="tiny-base", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4


def test_disconnect_reaches_the_engine_process(remote_stack):
    api_url, key, engine = remote_stack
    with httpx.Client(base_url=api_url, timeout=30) as http:
        deadline = time.monotonic() + 10
        while http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code != 200:
            time.sleep(0.1)
            assert time.monotonic() < deadline
        for _ in range(50):
            with http.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny-base", "messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 200, "stream": True}) as response:
                if response.status_code == 503:
                    time.sleep(0.2)
                    continue
                rid = response.headers["x-request-id"]
                lines = response.iter_lines()
                [next(lines) for _ in range(4)]
                break
    deadline = time.monotonic() + 3
    while rid not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.aborted
