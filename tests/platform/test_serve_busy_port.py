"""`loraplex serve` on a port already in use fails at once: before it creates the database, prints the
one-time admin key into a run that is about to fail, or spends time loading the model."""

from __future__ import annotations

import os
import socket

import pytest
from click.testing import CliRunner

from loraplex.platform.commands import serve


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def test_busy_port_is_refused_before_anything_is_created(data_dir, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # a model path that does not exist: reaching the model load would fail differently
        r = CliRunner().invoke(serve, ["--port", str(port), "--model", str(tmp_path / "no-model")])
    assert r.exit_code == 1, r.output
    assert f"cannot listen on 127.0.0.1:{port}" in r.output and "--port" in r.output
    assert "admin key" not in r.output
    assert not (data_dir / "loraplex.db").exists()


def test_unknown_host_is_refused_clearly(data_dir):
    r = CliRunner().invoke(serve, ["--host", "no-such-host.invalid", "--port", "8000"])
    assert r.exit_code == 1
    assert "cannot listen on no-such-host.invalid:8000" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_port_out_of_range_is_refused_before_anything_is_created(data_dir, port):
    # the socket API would take 99999 modulo 65536 for the probe, and the server then never came up
    r = CliRunner().invoke(serve, ["--port", port])
    assert r.exit_code == 2 and "is not in the range 0<=x<=65535" in r.output, r.output
    assert not (data_dir / "loraplex.db").exists()


def test_port_setting_out_of_range_names_the_variable(data_dir, monkeypatch):
    monkeypatch.setenv("LORAPLEX_PORT", "70000")
    r = CliRunner().invoke(serve, [])
    assert r.exit_code == 1 and "port (LORAPLEX_PORT)" in r.output and "65535" in r.output, r.output
    assert "Traceback" not in r.output and not (data_dir / "loraplex.db").exists()


def test_idle_connections_outlive_client_pools(data_dir, monkeypatch):
    """HTTP clients (httpx, the openai client) drop idle pooled connections after 5 s; a server that closes
    them at the same moment races with a client reusing one, which then reads ECONNRESET."""
    from types import SimpleNamespace

    import loraplex.platform.app as app_module
    from loraplex.platform.stopping import StoppingServer

    seen = {}
    monkeypatch.setattr(app_module, "create_app", lambda settings: SimpleNamespace(state=SimpleNamespace(services=None)))
    monkeypatch.setattr(StoppingServer, "run",
                        lambda self: seen.update(timeout_keep_alive=self.config.timeout_keep_alive))
    r = CliRunner().invoke(serve, ["--port", "0"])
    assert r.exit_code == 0, r.output
    assert seen["timeout_keep_alive"] == 75.0
    monkeypatch.setenv("LORAPLEX_KEEP_ALIVE_TIMEOUT", "20")
    r = CliRunner().invoke(serve, ["--port", "0"])
    assert r.exit_code == 0, r.output
    assert seen["timeout_keep_alive"] == 20.0
    monkeypatch.setenv("LORAPLEX_KEEP_ALIVE_TIMEOUT", "0")
    r = CliRunner().invoke(serve, ["--port", "0"])
    assert r.exit_code == 1 and "keep_alive_timeout" in r.output, r.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_is_refused_before_anything_is_created(data_dir, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("LORAPLEX_REDIS_URL", f"redis://:hunter2@127.0.0.1:{port}/0")
    r = CliRunner().invoke(serve, ["--no-engine", "--port", "0"])
    assert r.exit_code == 1, r.output
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0 (LORAPLEX_REDIS_URL)" in r.output
    assert "hunter2" not in r.output and "Traceback" not in r.output
    assert not (data_dir / "loraplex.db").exists()


def test_engine_refuses_unreachable_redis(data_dir, monkeypatch, tmp_path):
    from loraplex.platform.commands import engine

    monkeypatch.setenv("LORAPLEX_REDIS_URL", f"redis://127.0.0.1:{_closed_port()}/0")
    # a model that does not exist: without the check the command would fail at the model load, not serve
    r = CliRunner().invoke(engine, ["--port", "0", "--model", str(tmp_path / "no-model")])
    assert r.exit_code == 1 and "cannot reach Redis" in r.output, r.output


def test_engine_refuses_a_busy_port_before_registering(data_dir, tmp_path, monkeypatch):
    from loraplex.platform.commands import engine

    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda url: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_database", lambda settings, **_: None)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = CliRunner().invoke(engine, ["--port", str(port), "--model", str(tmp_path / "no-model")])
    assert r.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in r.output, r.output


def test_engine_holds_its_port_from_the_check_on(data_dir, tmp_path, monkeypatch):
    """The port check and the server's bind are one: the engine takes the port before it loads its model and
    serves on that socket, so a second engine started on the same port meanwhile (a copied command line) is
    refused in one line rather than passing the check, registering and failing in uvicorn's bind. With
    `--port 0` the port the system chose is the one it serves on."""
    from loraplex.platform.commands import engine
    from loraplex.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda url: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_database", lambda settings, **_: None)
    seen = {}

    def fake_run(settings, *, host, port, advertise=None, listener=None):
        seen["listener_port"] = listener.getsockname()[1]
        seen["second"] = CliRunner().invoke(engine, ["--port", str(seen["listener_port"]), "--model", str(model)])

    monkeypatch.setattr("loraplex.platform.remote.server.run_engine_server", fake_run)
    r = CliRunner().invoke(engine, ["--port", "0", "--model", str(model)])
    assert r.exit_code == 0, r.output
    port = seen["listener_port"]
    assert port != 0
    second = seen["second"]
    assert second.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in second.output, second.output
    with socket.socket() as after:  # and the port is let go once the engine process is done with it
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))


def test_engine_serves_on_the_socket_it_was_given(tmp_path, monkeypatch):
    """`run_engine_server` advertises and serves the port of the socket it was handed."""
    import uvicorn

    from loraplex.config import Settings
    from loraplex.platform.remote import server as engine_server

    seen = {}
    monkeypatch.setattr("loraplex.platform.engine_factory.build_engine", lambda settings: object())
    monkeypatch.setattr("loraplex.platform.redis_clients.async_redis", lambda settings: None)
    monkeypatch.setattr(engine_server, "build_engine_app",
                        lambda settings, engine, *, advertise, **_: seen.update(advertise=advertise))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(sockets=sockets))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        engine_server.run_engine_server(Settings(environment="test", data_dir=tmp_path), host="127.0.0.1", port=0,
                                        listener=listener)
        assert seen["sockets"] == [listener]
    assert seen["advertise"] == f"http://127.0.0.1:{port}"
