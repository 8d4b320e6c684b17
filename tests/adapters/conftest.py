"""Adapters made once per session with real PEFT on the shared tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
from adapter_helpers import AdapterCopy

from loraplex.adapters import MODULES, BaseModelSpec


@pytest.fixture(scope="session")
def llama_spec(tiny_llama_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_model_dir(tiny_llama_dir)


@pytest.fixture(scope="session")
def llama_adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rank 8, every projection: the adapter most refusal tests start from and then damage."""
    from loraplex.testing import make_peft_adapter

    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("llama_lora"), r=8,
                             target_modules=MODULES, seed=1)


@pytest.fixture
def adapter_copy(llama_adapter_dir: Path, tmp_path: Path) -> AdapterCopy:
    return AdapterCopy(llama_adapter_dir, tmp_path / "adapter")


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture
def q_keys() -> tuple[str, str]:
    return Q_A, Q_B
