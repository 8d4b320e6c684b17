"""Every benchmark script answers `--help` with its usage and runs nothing; an unknown flag is refused."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          cwd=BENCH.parent)


def test_every_script_found():
    assert "bench_decode_floor.py" in SCRIPTS and "bench_engine.py" in SCRIPTS


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_runs_nothing(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script}")
    assert "|" not in done.stdout.split("options:")[-1]  # no result table


@pytest.mark.slow
def test_decode_floor_refuses_unknown_flag():
    done = _run("bench_decode_floor.py", "--rows", "8")
    assert done.returncode == 2
    assert "unrecognized arguments: --rows 8" in done.stderr
    assert "Traceback" not in done.stderr
