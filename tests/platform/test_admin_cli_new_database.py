"""`loraplex admin` run where no database exists says that it created a new, empty one (a second database
next to the server's is otherwise invisible: tenants and keys made in it never work)."""

from __future__ import annotations

from click.testing import CliRunner

from loraplex.platform.commands import admin


def test_first_command_in_a_folder_without_a_database_says_so(elsewhere):
    runner = CliRunner()
    first = runner.invoke(admin, ["create-tenant", "acme"])
    assert first.exit_code == 0, first.output
    db = (elsewhere / ".loraplex" / "loraplex.db").resolve()
    assert f"there was no database at {db}" in first.stderr
    assert "LORAPLEX_DATA_DIR" in first.stderr
    # a production deployment's database is not under any folder: the hint names the setting that finds it
    assert "LORAPLEX_DATABASE_URL" in first.stderr
    assert "tenant acme" in first.stdout and "no database" not in first.stdout

    again = runner.invoke(admin, ["list-tenants"])
    assert again.exit_code == 0 and "acme" in again.stdout
    assert "no database" not in again.stderr
