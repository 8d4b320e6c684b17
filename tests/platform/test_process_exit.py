"""A server stopped by SIGTERM (a supervisor) or Ctrl-C that shuts down cleanly exits 0: uvicorn raised the
signal again after its graceful shutdown, so an engine process died of SIGTERM (status 143, which systemd and
Kubernetes count as a failure) and Ctrl-C ended in click's "Aborted!" with status 1. An engine whose engine
stopped on an error still exits 1 (tests/platform/test_engine_heartbeat.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from live_server import free_port, send_raw

# an engine process as `loraplex engine` runs it, with the fake engine and an in-memory Redis
_ENGINE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from fake_engine import FakeEngine
    from loraplex.config import Settings
    from loraplex.platform import engine_factory, redis_clients
    from loraplex.platform.remote import server

    class Redis:
        async def set(self, key, value, ex=None): pass
        async def delete(self, key): pass

    engine_factory.build_engine = lambda settings: FakeEngine()
    redis_clients.async_redis = lambda settings: Redis()
    settings = Settings(environment="test", data_dir={data!r}, redis_prefix="exit-test", shutdown_timeout=1,
                        pin_sync_interval=3600)
    server.run_engine_server(settings, host="127.0.0.1", port={port})
    print("run_engine_server returned")
""")


def _wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stdout.read()


def _start_and_stop(cmd: list[str], env: dict[str, str], port: int, sig: int) -> tuple[int, str]:
    """Start a server process, wait until it answers on `port`, check that it answers a request its HTTP
    parser refuses with the JSON error object, send it `sig`: (exit status, its output)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(proc, port)
        status, headers, body = send_raw(port, b"GET /readyz HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n")
        assert (status, headers["content-type"]) == (400, "application/json"), (status, headers, body)
        assert json.loads(body)["error"]["code"] == "invalid_http_request"
    except BaseException:
        proc.kill()
        raise
    return _stop(proc, sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_engine_process_stopped_by_a_signal_exits_0(tmp_path, sig):
    port = free_port()
    tests = str(Path(__file__).parent)
    script = _ENGINE.format(tests=tests, data=str(tmp_path), port=port)
    code, output = _start_and_stop([sys.executable, "-c", script], os.environ.copy(), port, sig)
    assert code == 0, (code, output)
    assert "run_engine_server returned" in output and "Traceback" not in output, output


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stopped_by_a_signal_exits_0_without_aborted(tmp_path, tiny_llama_dir, sig):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_DATA_DIR=str(tmp_path / "data"), LORAPLEX_SECRET_KEY="exit-test-secret-0123456789",
               LORAPLEX_KV_CACHE_MEMORY=str(4 * 1024 * 1024), LORAPLEX_MAX_MODEL_LEN="256")
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    code, output = _start_and_stop(cmd, env, port, sig)
    assert code == 0, (code, output)
    assert "Aborted!" not in output and "Traceback" not in output, output
    assert "Application shutdown complete" in output, output
