"""The secret that keys the API-key hashes is recorded (as a fingerprint) in the database: `loraplex admin`
and `loraplex serve` run with another LORAPLEX_SECRET_KEY (a shell without the deployment's settings) refuse
in one line, instead of making keys that no server accepts or serving with every key refused."""

from __future__ import annotations

from click.testing import CliRunner
from sqlalchemy import func, select

from loraplex.platform.commands import admin, serve


def _keys(data_dir) -> int:
    from loraplex.config import Settings
    from loraplex.platform.db import make_engine, make_session_factory, session_scope
    from loraplex.platform.models import ApiKey

    engine = make_engine(Settings(data_dir=data_dir).resolved_database_url, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return session.scalar(select(func.count()).select_from(ApiKey))
    finally:
        engine.dispose()


def test_admin_with_another_secret_makes_no_key(elsewhere, monkeypatch):
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "deployment-secret-0123456789")
    runner = CliRunner()
    made = runner.invoke(admin, ["create-tenant", "acme"])
    assert made.exit_code == 0, made.output
    first = runner.invoke(admin, ["create-key", "acme"])
    assert first.exit_code == 0, first.output

    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "another-secret-0123456789")
    refused = runner.invoke(admin, ["create-key", "acme"])
    assert refused.exit_code == 1, refused.output
    assert "LORAPLEX_SECRET_KEY is not the secret this database's API keys were made with" in refused.stderr
    assert "Traceback" not in refused.output and len(refused.stderr.strip().splitlines()) == 1
    assert _keys(elsewhere / ".loraplex") == 1

    monkeypatch.delenv("LORAPLEX_SECRET_KEY")  # the development default is another secret too
    assert runner.invoke(admin, ["list-tenants"]).exit_code == 1
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "deployment-secret-0123456789")
    again = runner.invoke(admin, ["create-key", "acme"])
    assert again.exit_code == 0, again.output
    assert _keys(elsewhere / ".loraplex") == 2


def test_serve_with_another_secret_refuses_to_start(elsewhere, monkeypatch):
    from types import SimpleNamespace

    import loraplex.platform.app as app_module
    from loraplex.platform.stopping import StoppingServer

    started = []
    monkeypatch.setattr(app_module, "create_app", lambda settings: SimpleNamespace(state=SimpleNamespace(services=None)))
    monkeypatch.setattr(StoppingServer, "run", lambda self: started.append(True))
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "deployment-secret-0123456789")
    monkeypatch.setenv("LORAPLEX_MODEL", str(elsewhere / "no-model"))
    monkeypatch.setattr("loraplex.platform.commands._refuse_bad_model", lambda settings: None)
    r = CliRunner().invoke(serve, ["--port", "0"])
    assert r.exit_code == 0 and started == [True], r.output

    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "another-secret-0123456789")
    r = CliRunner().invoke(serve, ["--port", "0"])
    assert r.exit_code == 1 and "LORAPLEX_SECRET_KEY is not the secret" in r.output, r.output
    assert started == [True] and "admin key" not in r.output
