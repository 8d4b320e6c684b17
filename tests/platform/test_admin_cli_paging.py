"""`loraplex admin list-*` with --limit/--after/--search."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from loraplex.platform.commands import admin


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_SECRET_KEY", "cli-test-secret-0123456789")
    return tmp_path / "data"


def _names(output: str) -> list[str]:
    return [line.split("\t")[1] for line in output.splitlines() if "\t" in line]


def test_list_tenants_pages_and_searches(cli_env):
    runner = CliRunner()
    for name in ("shop_a", "shop_b", "shopxc", "other"):
        assert runner.invoke(admin, ["create-tenant", name]).exit_code == 0
    r = runner.invoke(admin, ["list-tenants"])
    assert _names(r.output) == ["shop_a", "shop_b", "shopxc", "other"]  # no option: every tenant, as before

    r = runner.invoke(admin, ["list-tenants", "--search", "SHOP_", "--limit", "1"])
    assert r.exit_code == 0, r.output
    assert _names(r.stdout) == ["shop_a"]
    assert "--after 1" in r.stderr
    r = runner.invoke(admin, ["list-tenants", "--search", "shop_", "--limit", "1", "--after", "1"])
    assert _names(r.stdout) == ["shop_b"] and "more rows follow" not in r.stderr

    r = runner.invoke(admin, ["create-key", "shop_a", "--name", "deploy"])
    assert r.exit_code == 0
    r = runner.invoke(admin, ["list-keys", "shop_a", "--search", "DEP"])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 1 and "\tdeploy\t" in r.stdout


@pytest.mark.parametrize(("args", "option"), [(["--limit", "0"], "--limit"), (["--after", "x"], "--after"),
                                             (["--search", "s" * 300], "--search")])
def test_bad_page_options_are_readable(cli_env, args, option):
    r = CliRunner().invoke(admin, ["list-tenants", *args])
    assert r.exit_code == 2
    assert option in r.output and "Traceback" not in r.output
