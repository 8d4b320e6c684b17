"""Fixtures shared by every area: tiny random models made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
