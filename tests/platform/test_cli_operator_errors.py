"""What a new operator gets wrong first (a data folder that is a file, a database that is not one, a host that is
no address, a model name with a typo) is said in one `Error:` line, never a traceback or a driver's second line."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from loraplex.cli import main


@pytest.fixture
def env(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "cli-test-secret-0123456789")
    return tmp_path


def _one_error_line(result, *words):
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for word in words:
        assert word in lines[0], result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


@pytest.mark.parametrize("command", [["admin", "list-tenants"], ["serve", "--port", "0"]])
def test_a_data_folder_that_is_a_file_is_named(env, monkeypatch, command):
    (env / "afile").write_text("not a folder")
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env / "afile"))
    _one_error_line(CliRunner().invoke(main, command), "cannot use the data folder", "it is a file, not a folder")
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env / "afile" / "sub"))
    _one_error_line(CliRunner().invoke(main, command), "a part of its path is a file")


def test_a_file_that_is_not_a_database_is_one_line(env, monkeypatch):
    (env / "loraplex.db").write_text("garbage, not SQLite")
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env))
    result = CliRunner().invoke(main, ["admin", "list-tenants"])
    _one_error_line(result, "cannot prepare the database", "file is not a database")
    assert "sqlalche.me" not in result.output


def test_an_unreachable_database_is_one_line_with_the_drivers_hint(env, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql://u:s3cret@127.0.0.1:1/db")
    for command in (["admin", "list-tenants"], ["serve", "--port", "0"]):
        result = CliRunner().invoke(main, command)
        _one_error_line(result, "cannot reach the database postgresql://u:***@127.0.0.1:1/db", "Connection refused")
        assert "s3cret" not in result.output and "sqlalche.me" not in result.output


def test_a_host_that_is_no_address_is_not_told_to_change_its_port(env, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env))
    result = CliRunner().invoke(main, ["serve", "--host", "999.1.1.1", "--port", "0"])
    _one_error_line(result, "cannot listen on 999.1.1.1:0", "--host an address of this machine")
    assert "--port" not in result.output


def test_empty_key_listings_say_how_to_make_one(env, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env))
    runner = CliRunner()
    assert runner.invoke(main, ["admin", "create-tenant", "acme"]).exit_code == 0
    keys = runner.invoke(main, ["admin", "list-keys", "acme"])
    assert keys.exit_code == 0 and keys.stdout == ""  # scripts read one line per key
    assert "`loraplex admin create-key acme`" in keys.stderr
    admin_keys = runner.invoke(main, ["admin", "list-admin-keys"])
    assert admin_keys.exit_code == 0 and admin_keys.stdout == ""
    assert "`loraplex admin create-admin-key`" in admin_keys.stderr


def test_model_fetch_of_an_unknown_name_says_what_fetch_is_for(env):
    result = CliRunner().invoke(main, ["model", "fetch", "./my-model"])
    assert result.exit_code == 2
    assert "'./my-model' is not a built-in demo model (known: smollm2-135m)" in result.output
    assert "pass it to --model" in result.output and "[smollm2-135m]" not in result.output


def test_model_fetch_into_a_cache_under_a_file_fails_before_downloading(env, monkeypatch):
    import loraplex.engine.fetch as fetch

    monkeypatch.setattr(fetch, "_download_gguf", lambda *a: pytest.fail("downloaded into an unusable cache"))
    (env / "afile").write_text("x")
    result = CliRunner().invoke(main, ["model", "fetch", "--force", "--cache-dir", str(env / "afile" / "models")])
    _one_error_line(result, "cannot use the model cache", "a part of its path is a file")


def test_an_expiry_past_the_calendar_is_an_error_line(env, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(env))
    assert CliRunner().invoke(main, ["admin", "create-tenant", "acme"]).exit_code == 0
    for when in ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00"):
        result = CliRunner().invoke(main, ["admin", "create-key", "acme", "--expires-in", when])
        _one_error_line(result, "outside the years 1 to 9999 in UTC")
    # a time from now that far was an OverflowError traceback
    result = CliRunner().invoke(main, ["admin", "create-key", "acme", "--expires-in", "999999w"])
    assert result.exit_code == 2 and "'999999w' from now is past the year 9999" in result.output, result.output
    assert isinstance(result.exception, SystemExit), result.exception


def test_generate_for_a_tenant_with_an_unreachable_database_is_one_line(env, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql://u:s3cret@127.0.0.1:1/db")
    result = CliRunner().invoke(main, ["generate", "--tenant", "acme", "--adapter", "bot", "hi"])
    _one_error_line(result, "cannot read the database postgresql://u:***@127.0.0.1:1/db", "Connection refused")
