"""README.md stays true to the code: its Python examples compile and use only names they define, its
`loraplex` command lines name real commands and flags, and its Settings table lists every setting with its
default."""

from __future__ import annotations

import ast
import builtins
import py_compile
import re
import shlex
from pathlib import Path

import click
import pytest

from loraplex.cli import main
from loraplex.config import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)
PYTHON_BLOCKS = [code for lang, code in BLOCKS if lang == "python"]
SHELL_LINES = [line.split("  #")[0].strip() for lang, code in BLOCKS if lang in ("bash", "sh", "shell")
               for line in code.replace("\\\n", " ").splitlines()]
COMMAND_LINES = [line for line in SHELL_LINES if line.startswith("loraplex ")]
TABLE_ROWS = dict(re.findall(r"^\| `(LORAPLEX_\w+)` \| ([^|]*) \|", README, re.M))


def _undefined_names(code: str) -> set[str]:
    """Names the block reads that nothing in it binds and that are not builtins."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def test_readme_has_the_examples_these_tests_read():
    assert len(PYTHON_BLOCKS) >= 2
    assert any(line.startswith("loraplex generate") for line in COMMAND_LINES)
    assert "LORAPLEX_MODEL" in TABLE_ROWS


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_example_compiles_and_defines_what_it_uses(index, tmp_path):
    code = PYTHON_BLOCKS[index]
    path = tmp_path / f"readme_example_{index}.py"
    path.write_text(code)
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)
    assert _undefined_names(code) == set(), f"README python example {index} uses names it never defines"


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_command_line_names_real_commands_and_flags(line):
    args = shlex.split(line)[1:]
    command: click.Command = main
    ctx = click.Context(main, info_name="loraplex")
    while isinstance(command, click.Group):
        name = args.pop(0)
        command = command.get_command(ctx, name)
        assert command is not None, f"no command {name!r} in: {line}"
        assert not (command.help or "").startswith("(unavailable"), command.help
        ctx = click.Context(command, info_name=name, parent=ctx)
    known = {opt for param in command.params for opt in getattr(param, "opts", [])}
    flags = {arg.split("=")[0] for arg in args if arg.startswith("--")}
    assert flags <= known, f"unknown flags {sorted(flags - known)} in: {line}"
    command.make_context(command.name, list(args), parent=ctx)  # the arguments parse


def test_settings_table_lists_every_setting():
    fields = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    assert set(TABLE_ROWS) - fields == set(), "the README's Settings table lists settings config.py lacks"
    assert fields - set(TABLE_ROWS) == set(), "settings missing from the README's Settings table"


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_settings_table_gives_each_default(name):
    cell = TABLE_ROWS[f"LORAPLEX_{name.upper()}"].strip()
    default = Settings.model_fields[name].default
    if default is None:
        assert cell == "unset"
        return
    written = re.fullmatch(r"`([^`]*)`", cell)
    assert written, f"LORAPLEX_{name.upper()}: default {cell!r} is not one `value`"
    value = written.group(1)
    if isinstance(default, bool):
        assert value == str(default).lower()
    elif isinstance(default, (int, float)):
        assert float(value) == default
    else:
        assert value == str(default)


def test_every_variable_named_is_a_setting_or_one_the_package_reads():
    read_directly = {match for path in (ROOT / "loraplex").rglob("*.py")
                     for match in re.findall(r"(?:environ\.get\(|getenv\(|environ\[)\s*\"(LORAPLEX_\w+)\"",
                                             path.read_text())}
    fields = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}
    named = set(re.findall(r"LORAPLEX_[A-Z0-9_]*[A-Z0-9]", README))
    assert named - fields - read_directly == set(), "the README names variables nothing reads"
    assert read_directly - named == set(), "variables the package reads that the README does not name"


@pytest.mark.parametrize("name", ["docker/compose.yaml", "docker/Dockerfile"])
def test_deployment_files_set_only_real_settings(name):
    fields = {f"LORAPLEX_{field.upper()}" for field in Settings.model_fields}
    named = set(re.findall(r"LORAPLEX_[A-Z0-9_]*[A-Z0-9]", (ROOT / name).read_text()))
    assert named and named <= fields, sorted(named - fields)
