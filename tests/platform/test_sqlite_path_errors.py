"""A SQLite LORAPLEX_DATABASE_URL that cannot be opened: SQLite says only "unable to open database file";
every command says which path and why (its folder missing, a file in its way, not writable)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from live_server import free_port

from loraplex.platform.commands import admin, engine, serve, worker
from loraplex.platform.db_errors import sqlite_path_problem


@pytest.fixture
def env(elsewhere, monkeypatch):
    tmp_path = elsewhere
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "sqlite-path-secret-0123456789")
    monkeypatch.setattr("loraplex.platform.commands._refuse_unreachable_redis", lambda settings: None)
    monkeypatch.setattr("loraplex.platform.commands._refuse_bad_model", lambda model: None)
    monkeypatch.setattr("celery.Celery.worker_main", lambda self, argv: pytest.fail("the worker started"))
    monkeypatch.setattr("loraplex.platform.remote.server.run_engine_server",
                        lambda settings, **kwargs: pytest.fail("the engine started"))
    return tmp_path


def _commands(port: int):
    return [("serve", serve, ["--port", str(port)]), ("admin", admin, ["list-tenants"]),
            ("worker", worker, []), ("engine", engine, ["--port", str(port)])]


def test_every_command_names_the_missing_folder_of_a_sqlite_database(env, monkeypatch):
    folder = env / "nowhere" / "sub"
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"sqlite:///{folder}/loraplex.db")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/12")
    for name, command, args in _commands(free_port()):
        r = CliRunner().invoke(command, args)
        assert r.exit_code == 1, (name, r.output)
        assert f"its folder {folder} does not exist" in r.output, (name, r.output)
        assert "unable to open database file" not in r.output and "Traceback" not in r.output, (name, r.output)
    assert not folder.exists()


def test_a_file_in_the_way_of_the_folder_is_named(env, monkeypatch):
    blocker = env / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"sqlite:///{blocker}/sub/loraplex.db")
    r = CliRunner().invoke(admin, ["list-tenants"])
    assert r.exit_code == 1 and f"{blocker} is a file, not a folder" in r.output, r.output
    assert "LORAPLEX_DATABASE_URL" in r.output, r.output


def test_a_folder_this_user_cannot_write_is_named(tmp_path, monkeypatch):
    """(Checked through os.access: a test run as root could write anywhere.)"""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else
                        real_access(path, mode))
    assert sqlite_path_problem(f"sqlite:///{tmp_path}/x.db") == f"its folder {tmp_path} is not writable by this user"
    assert sqlite_path_problem(f"sqlite:///{tmp_path / 'sub'}/x.db") == f"its folder {tmp_path / 'sub'} does not exist"
    assert sqlite_path_problem("sqlite://") is None and sqlite_path_problem("postgresql://u@h/db") is None
