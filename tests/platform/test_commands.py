"""`loraplex serve` as a user starts it, and the `loraplex admin` commands with their readable errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner
from live_server import free_port
from platform_helpers import admin_cli

from loraplex.platform.commands import admin


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "cli-test-secret-0123456789")
    return tmp_path / "data"


def test_admin_commands(cli_env):
    runner = CliRunner()
    for command, words in (("list-plans", "no plans yet"), ("list-tenants", "no tenants yet")):
        r = runner.invoke(admin, [command])
        assert r.exit_code == 0 and words in r.stderr and r.stdout == "", (command, r.output)
    r = runner.invoke(admin, ["create-plan", "pro", "--rpm", "10", "--tpm", "1000", "--concurrent", "2",
                              "--monthly-tokens", "100000"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(admin, ["create-tenant", "acme", "--plan", "pro", "--rpm", "5"])
    assert r.exit_code == 0 and "5 req/min" in r.output and "1000 tokens/min" in r.output
    r = runner.invoke(admin, ["create-key", "1", "--scope", "inference"])  # the tenant by its id
    assert r.exit_code == 0 and "for tenant acme (scopes: inference)" in r.stderr, r.output
    key = r.stdout.strip().splitlines()[-1]
    assert key.startswith("lpx_")
    r = runner.invoke(admin, ["list-keys", "acme"])
    assert key[:12] in r.output and key not in r.output and "active" in r.output
    assert runner.invoke(admin, ["revoke-key", "1"]).exit_code == 0
    assert "revoked" in runner.invoke(admin, ["list-keys", "acme"]).output

    for args, message in [
        (["create-tenant", "acme"], "already exists"),
        (["create-tenant", "ACME"], "a tenant named 'acme' already exists, and tenant names are unique whatever"),
        (["create-plan", "Pro", "--rpm", "1", "--tpm", "1", "--concurrent", "1", "--monthly-tokens", "1"],
         "a plan named 'pro' already exists, and plan names are unique whatever their case"),
        (["create-key", "acme", "--name", ""], "name must not be empty"),
        (["create-tenant", "x", "--plan", "gold"], "unknown plan 'gold'; known plans: pro"),
        (["create-key", "nobody"], "no tenant 'nobody'"),
        (["revoke-key", "99"], "no API key with id 99"),
        (["create-plan", "half", "--rpm", "1"], "a plan needs every quota"),
        (["set-quota", "acme"], "nothing to change"),
        # validation errors in words: the field, the rule, no regex, no "Value error,"
        (["create-tenant", "<b>p3</b>"], "Error: name must be 1-64 letters, digits, '.', '_' or '-', starting with"),
        (["create-tenant", "héllo"], "name must be 1-64 letters"),
        (["create-tenant", "123"], "Error: name: a tenant name must not be digits only"),
        (["create-key", "acme", "--name", "k" * 65], "Error: name must be at most 64 characters long (this one has 65)"),
        (["create-plan", "<p>", "--rpm", "0", "--tpm", "1", "--concurrent", "1", "--monthly-tokens", "1"],
         "name must be 1-64 letters"),
    ]:
        r = runner.invoke(admin, args)
        assert r.exit_code == 1 and message in r.output, (args, r.output)
        assert "Traceback" not in r.output
        assert "should match pattern" not in r.output and "Value error" not in r.output and "^[" not in r.output
    for args, message in [
        (["revoke-key", "abc"], "expects a key id, a number as `loraplex admin list-keys TENANT` shows it"),
        (["revoke-key", "0"], "no key has id 0"),
        (["revoke-admin-key", "first"], "expects a key id, a number as `loraplex admin list-admin-keys` shows"),
    ]:
        r = runner.invoke(admin, args)
        assert r.exit_code == 2 and message in r.output and "integer range" not in r.output, (args, r.output)


def test_plans_are_listed_updated_and_deleted_from_the_command_line(cli_env):
    run = admin_cli()

    run("create-plan", "tiny", "--rpm", "1", "--tpm", "1", "--concurrent", "1", "--monthly-tokens", "1")
    run("create-plan", "spare", "--rpm", "5", "--tpm", "5", "--concurrent", "1", "--monthly-tokens", "5")
    run("create-tenant", "acme", "--plan", "tiny")
    run("create-tenant", "own", "--plan", "tiny", "--rpm", "3")
    assert "tiny\trpm=1\ttpm=1\tconcurrent=1\tmonthly_tokens=1\ttenants=2" in run("list-plans")
    out = run("update-plan", "tiny", "--rpm", "600", "--monthly-tokens", "1000000")
    assert "600 req/min" in out and "1 tokens/min" in out and "1000000 tokens/month" in out
    listed = run("list-tenants")
    assert "acme\tactive\tplan=tiny\trpm=600(plan)" in listed and "own\tactive\tplan=tiny\trpm=3(own)" in listed
    assert "nothing to change" in run("update-plan", "tiny", code=1)
    assert "already exists" in run("update-plan", "tiny", "--name", "spare", code=1)
    assert "unknown plan 'gold'" in run("update-plan", "gold", "--rpm", "2", code=1)
    assert "at most 2,147,483,647" in run("update-plan", "tiny", "--rpm", str(2**31), code=1)
    assert "has 2 tenant(s): acme, own" in run("delete-plan", "tiny", code=1)
    run("delete-plan", "spare")
    assert "spare" not in run("list-plans")


def test_set_quota_clears_overrides_and_list_tenants_says_where_each_quota_comes_from(cli_env):
    runner = CliRunner()

    def run(*args):
        r = runner.invoke(admin, list(args))
        assert r.exit_code == 0, r.output
        return r.output

    run("create-plan", "pro", "--rpm", "10", "--tpm", "1000", "--concurrent", "2", "--monthly-tokens", "100000")
    run("create-tenant", "zeta", "--rpm", "600", "--tpm", "5000", "--concurrent", "3")
    listed = run("list-tenants")
    assert "rpm=600(own)" in listed and "concurrent=3(own)" in listed and "monthly_tokens=" in listed
    assert "(default)" in listed.split("concurrent=3(own)")[1]  # no plan: the monthly budget is the default
    run("set-quota", "zeta", "--plan", "pro", "--clear", "rpm", "--clear", "tpm")
    listed = run("list-tenants")
    assert "rpm=10(plan)" in listed and "tpm=1000(plan)" in listed and "concurrent=3(own)" in listed
    assert "monthly_tokens=100000(plan)" in listed
    run("set-quota", "zeta", "--clear", "all")
    assert "concurrent=2(plan)" in run("list-tenants")
    run("set-quota", "zeta", "--plan", "")
    assert "plan=-" in run("list-tenants") and "rpm=" in run("list-tenants")
    assert "--plan \"\" removes the plan" in " ".join(run("set-quota", "--help").split())
    both = runner.invoke(admin, ["set-quota", "zeta", "--rpm", "5", "--clear", "all"])
    assert both.exit_code == 1 and "contradict" in both.output
    assert runner.invoke(admin, ["set-quota", "zeta", "--clear", "rps"]).exit_code == 2


def _wait_for_serve(proc: subprocess.Popen, port: int) -> int:
    """The status of /healthz once `loraplex serve` answers (its output in the error if it exits first)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read()) from None
            time.sleep(0.2)
    raise AssertionError("serve did not come up")


@pytest.mark.slow
def test_serve_prints_admin_key_once_and_serves(cli_env, tiny_llama_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    env = {**os.environ, "LORAPLEX_KV_CACHE_MEMORY": str(4 * 1024 * 1024), "LORAPLEX_MAX_MODEL_LEN": "256"}

    def run_once() -> tuple[str, int]:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            status = _wait_for_serve(proc, port)
        finally:
            proc.terminate()
            output, _ = proc.communicate(timeout=60)
        return output, status

    first, status = run_once()
    assert status == 200
    keys = [w for w in first.split() if w.startswith("lpx_admin_")]
    assert len(keys) == 1, first
    assert (cli_env / "loraplex.db").exists()
    second, _ = run_once()
    assert "lpx_admin_" not in second


def test_serve_refuses_the_default_secret_in_production(cli_env, monkeypatch):
    from loraplex.platform.commands import serve

    monkeypatch.delenv("LORAPLEX_SECRET_KEY")
    monkeypatch.setenv("LORAPLEX_ENVIRONMENT", "production")
    r = CliRunner().invoke(serve, [])
    assert r.exit_code == 1 and "LORAPLEX_SECRET_KEY must be set" in r.output
    assert "Traceback" not in r.output


def test_serve_with_auto_migrate_off_never_migrates_and_names_the_migrate_command(cli_env, monkeypatch):
    """LORAPLEX_AUTO_MIGRATE=false: `loraplex serve` migrated its database anyway before the app started.
    It must leave the schema alone and, while the database is behind, refuse in one line naming
    `loraplex migrate`; once that has run, serve goes on."""
    from alembic import command
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine, inspect

    from loraplex.cli import main
    from loraplex.platform.commands import serve
    from loraplex.platform.migrate import alembic_config

    monkeypatch.setenv("LORAPLEX_AUTO_MIGRATE", "false")
    monkeypatch.setattr("loraplex.platform.commands._refuse_bad_model", lambda settings: None)
    reached = []

    def past_the_database(settings):  # the next step of serve: the database check let it through
        reached.append(settings)
        raise SystemExit(0)

    monkeypatch.setattr("loraplex.platform.commands.refuse_another_key_secret", past_the_database)
    database = cli_env / "loraplex.db"
    url = f"sqlite:///{database}"

    def serve_once():
        r = CliRunner().invoke(serve, ["--port", str(free_port())])
        return r, r.output.strip().splitlines()

    r, lines = serve_once()  # a new database: nothing created, nothing served
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert "`loraplex migrate`" in r.output and "LORAPLEX_AUTO_MIGRATE is false" in r.output, r.output
    assert "Traceback" not in r.output and not database.exists() and not reached

    script = ScriptDirectory.from_config(alembic_config(url))
    previous = script.get_revision(script.get_current_head()).down_revision
    cli_env.mkdir(exist_ok=True)
    command.upgrade(alembic_config(url), previous)  # a database one migration behind this version
    r, lines = serve_once()
    assert r.exit_code == 1 and len(lines) == 1 and f"is at revision {previous}" in r.output, r.output
    assert "`loraplex migrate`" in r.output and not reached
    engine = create_engine(url)
    try:  # serve left the schema where it was
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == previous
    finally:
        engine.dispose()

    r = CliRunner().invoke(main, ["migrate"])  # the documented command, as the `loraplex` group runs it
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    r, _ = serve_once()
    assert r.exit_code == 0 and len(reached) == 1, r.output
    engine = create_engine(url)
    try:
        assert inspect(engine).has_table("tenants")
    finally:
        engine.dispose()


def test_worker_and_engine_need_redis(cli_env):
    from loraplex.platform.commands import engine, worker

    for command in (worker, engine):
        r = CliRunner().invoke(command, [])
        assert r.exit_code == 1 and "LORAPLEX_REDIS_URL" in r.output


def test_serve_and_engine_name_a_model_they_cannot_serve_in_one_line(cli_env, tmp_path, monkeypatch):
    """A missing model, or a folder that holds none, is an `Error:` line before any server starts (it was a
    start-up traceback from the server's lifespan)."""
    from loraplex.platform.commands import engine, serve

    empty = tmp_path / "not-a-model"
    empty.mkdir()
    for model, message in [(str(tmp_path / "nowhere"), "not found"), (str(empty), "config.json")]:
        r = CliRunner().invoke(serve, ["--model", model, "--port", str(free_port())])
        assert r.exit_code == 1, r.output
        assert "Error: cannot serve the model" in r.output and message in r.output, r.output
        assert "Traceback" not in r.output
        assert "should match pattern" not in r.output and "Value error" not in r.output and "^[" not in r.output
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda url: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_database", lambda settings, **_: None)
    r = CliRunner().invoke(engine, ["--model", str(empty), "--port", str(free_port())])
    assert r.exit_code == 1 and "Error: cannot serve the model" in r.output and "config.json" in r.output, r.output


def test_serve_and_engine_name_an_engine_setting_they_cannot_serve_with_in_one_line(cli_env, tiny_llama_dir,
                                                                                       monkeypatch):
    """Engine settings out of range, or ones the model cannot be served with, were a start-up traceback from
    the server's lifespan ("Application startup failed")."""
    from loraplex.platform.commands import engine, serve

    started = []
    monkeypatch.setattr("uvicorn.Config", lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr("loraplex.platform.remote.server.run_engine_server",
                        lambda settings, **kwargs: started.append(settings))
    cases = [("MAX_NUM_SEQS", "-1", "max_num_seqs (LORAPLEX_MAX_NUM_SEQS)"),
             ("MAX_NUM_BATCHED_TOKENS", "0", "max_num_batched_tokens (LORAPLEX_MAX_NUM_BATCHED_TOKENS)"),
             ("MAX_LORAS", "-1", "max_loras (LORAPLEX_MAX_LORAS)"),
             ("DTYPE", "fp16", "dtype (LORAPLEX_DTYPE)"),
             ("LORA_DTYPE", "int8", "lora_dtype (LORAPLEX_LORA_DTYPE)"),
             ("USAGE_FLUSH_INTERVAL", "0", "usage_flush_interval (LORAPLEX_USAGE_FLUSH_INTERVAL)"),
             ("DEFAULT_REQUESTS_PER_MINUTE", "0", "default_requests_per_minute"),
             ("MAX_MODEL_LEN", "100000", "max_model_len 100000 exceeds the model's 512 positions "
                                         "(LORAPLEX_MAX_MODEL_LEN)"),
             ("KV_CACHE_MEMORY", "10", "holds no block")]
    for name, value, words in cases:
        monkeypatch.setenv(f"LORAPLEX_{name}", value)
        r = CliRunner().invoke(serve, ["--model", str(tiny_llama_dir), "--port", str(free_port())])
        assert r.exit_code == 1 and words in r.output, (name, r.output)
        assert "Traceback" not in r.output, r.output
        monkeypatch.delenv(f"LORAPLEX_{name}")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda url: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_database", lambda settings, **_: None)
    monkeypatch.setenv("LORAPLEX_MAX_MODEL_LEN", "100000")
    r = CliRunner().invoke(engine, ["--model", str(tiny_llama_dir), "--port", str(free_port())])
    assert r.exit_code == 1 and "(LORAPLEX_MAX_MODEL_LEN)" in r.output, r.output
    assert not started


def test_a_worker_that_cannot_reach_its_database_says_so_before_taking_tasks(cli_env, monkeypatch):
    """A worker with a wrong database URL used to start, take validation tasks off the queue and fail them,
    leaving uploads pending."""
    from loraplex.platform.commands import worker

    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/loraplex_no_such_db")
    started = []
    monkeypatch.setattr("celery.Celery.worker_main", lambda self, argv: started.append(argv))
    r = CliRunner().invoke(worker, [])
    assert r.exit_code == 1, r.output
    assert "cannot reach the database" in r.output and "loraplex_no_such_db" in r.output
    assert "Traceback" not in r.output and not started


def test_an_engine_without_the_platform_database_says_so_before_serving(cli_env, monkeypatch):
    """An engine with LORAPLEX_DATABASE_URL unset fell back to a SQLite file without the platform's tables:
    it registered and served, but its pin sync failed forever ("no such table: adapter_versions")."""
    from loraplex.config import Settings
    from loraplex.platform.bootstrap import prepare_database
    from loraplex.platform.commands import engine

    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda url: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_bad_model", lambda model: None)
    started = []
    monkeypatch.setattr("loraplex.platform.remote.server.run_engine_server",
                        lambda settings, **kwargs: started.append(settings))

    def run():
        return CliRunner().invoke(engine, ["--port", str(free_port())])

    for database in ("no data dir", "no SQLite file", "empty SQLite file", "unreachable PostgreSQL"):
        if database == "no SQLite file":
            cli_env.mkdir()
        if database == "empty SQLite file":
            (cli_env / "loraplex.db").touch()
        if database == "unreachable PostgreSQL":
            monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/loraplex_no_such_db")
        r = run()
        assert r.exit_code == 1, (database, r.output)
        assert "LORAPLEX_DATABASE_URL" in r.output and "engine processes read adapter pins" in r.output, r.output
        assert ("loraplex_no_such_db" if "PostgreSQL" in database else "loraplex.db") in r.output, r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
        if database == "empty SQLite file":
            assert "no platform tables" in r.output, r.output
        if database == "no SQLite file":  # refused without leaving an empty database file in the data directory
            assert "does not exist" in r.output, r.output
            assert not (cli_env / "loraplex.db").exists()
    assert not started

    monkeypatch.delenv("LORAPLEX_DATABASE_URL")
    prepare_database(Settings())  # the platform's database: the engine starts
    r = run()
    assert r.exit_code == 0 and len(started) == 1, r.output


@pytest.mark.slow
def test_sigterm_stops_serve_after_the_shutdown_timeout_with_a_request_still_running(cli_env, tiny_llama_dir):
    """A request that never completes (here: a body that never arrives) does not keep a stopping server up
    past LORAPLEX_SHUTDOWN_TIMEOUT; the server answered before and exits cleanly after."""
    import signal
    import socket

    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    env = {**os.environ, "LORAPLEX_KV_CACHE_MEMORY": str(4 * 1024 * 1024), "LORAPLEX_MAX_MODEL_LEN": "256",
           "LORAPLEX_SHUTDOWN_TIMEOUT": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for_serve(proc, port) == 200
        with socket.create_connection(("127.0.0.1", port)) as stuck:
            stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer lpx_nothing\r\nContent-Length: 1000\r\n\r\n{\"model\"")
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=90)  # without the timeout it waits for that body forever
            except subprocess.TimeoutExpired:
                raise AssertionError("serve kept running with a request open after SIGTERM") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert code == 0, output  # a clean stop, not the signal uvicorn stopped for raised again
    assert "timeout graceful shutdown exceeded" in output and "Application shutdown complete" in output, output
