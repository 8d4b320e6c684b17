"""Fixtures shared by every area: tiny random models made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build (first run on a machine) or load the C++ CPU kernels once, before any test starts an engine or
    a server, so that no test's start-up wait includes a compiler run."""
    from loraplex.engine.llm_engine import prepare_cpu_kernels

    prepare_cpu_kernels(lora=True)


def _tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    from loraplex.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "tied")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "phi3")
