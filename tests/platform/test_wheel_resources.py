"""A wheel install (not editable) carries the migrations and the console's assets, and finds them."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loraplex.resources import resource_dir

ROOT = Path(__file__).resolve().parents[2]


def test_checkout_resources_are_found():
    assert (resource_dir("migrations") / "env.py").is_file()
    assert (resource_dir("web") / "templates" / "base.html").is_file()


def test_installed_prefix_is_the_fallback(tmp_path, monkeypatch):
    import loraplex.resources as resources

    monkeypatch.setattr(resources, "_SOURCE_ROOT", tmp_path / "site-packages")
    (tmp_path / "prefix" / "share" / "loraplex" / "web").mkdir(parents=True)
    assert resource_dir("web", prefixes=(str(tmp_path / "prefix"),)) == tmp_path / "prefix/share/loraplex/web"
    # neither place: the checkout path comes back for the caller's error message
    assert resource_dir("migrations", prefixes=(str(tmp_path / "prefix"),)) == tmp_path / "site-packages/migrations"


@pytest.mark.slow
def test_wheel_ships_migrations_and_console_assets(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True,
    )
    # Unpack the wheel the way an installer lays it out (pip itself is kept away from this environment:
    # an install with --prefix would first uninstall the editable copy the tests run from).
    wheel = next(wheels.glob("loraplex-*.whl"))
    purelib, prefix = tmp_path / "site-packages", tmp_path / "prefix"
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            data = re.match(r"^[^/]+\.data/data/(.+)$", member)
            target = prefix / data.group(1) if data else purelib / member
            target.parent.mkdir(parents=True, exist_ok=True)
            if not member.endswith("/"):
                target.write_bytes(zf.read(member))
    db = tmp_path / "wheel.db"
    script = f"""
import loraplex, loraplex.resources as r
from alembic import command
from alembic.config import Config
assert loraplex.__file__.startswith({str(purelib)!r}), loraplex.__file__
migrations = r.resource_dir("migrations", prefixes=({str(prefix)!r},))
web = r.resource_dir("web", prefixes=({str(prefix)!r},))
assert str(migrations).startswith({str(prefix)!r}), migrations
assert (web / "templates" / "base.html").is_file() and (web / "static" / "css" / "console.css").is_file()
config = Config()
config.set_main_option("script_location", str(migrations))
config.set_main_option("sqlalchemy.url", "sqlite:///{db}")
command.upgrade(config, "head")
print("ok")
"""
    env = {"PYTHONPATH": str(purelib), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
    assert db.stat().st_size > 0
