"""Fixtures for the integration tests (real PostgreSQL, Redis and Celery worker processes)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def peft_adapter_zip(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplex.testing import make_peft_adapter

    adapter = make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("it_peft"), r=4,
                                target_modules=("q_proj", "v_proj"), seed=7)
    path = tmp_path_factory.mktemp("it_peftzip") / "adapter.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(adapter.iterdir()):
            if f.is_file():
                zf.write(f, f.name)
    return path
