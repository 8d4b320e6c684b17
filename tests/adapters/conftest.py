"""Adapters made once per session with real PEFT on the shared tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

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


class AdapterCopy:
    """A writable copy of a PEFT adapter folder, for tests that damage one thing and expect a refusal."""

    def __init__(self, src: Path, dst: Path):
        import shutil

        shutil.copytree(src, dst)
        self.path = dst

    @property
    def config_path(self) -> Path:
        return self.path / "adapter_config.json"

    @property
    def weights_path(self) -> Path:
        return self.path / "adapter_model.safetensors"

    def update_config(self, **changes) -> None:
        import json

        config = json.loads(self.config_path.read_text())
        config.update(changes)
        self.config_path.write_text(json.dumps(config))

    def tensors(self) -> dict:
        from safetensors.torch import load_file

        # load_file maps the file; copies keep the tensors valid after the file is rewritten
        return {k: v.clone() for k, v in load_file(str(self.weights_path)).items()}

    def save_tensors(self, tensors: dict) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.weights_path))


@pytest.fixture
def adapter_copy(llama_adapter_dir: Path, tmp_path: Path) -> AdapterCopy:
    return AdapterCopy(llama_adapter_dir, tmp_path / "adapter")


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture
def q_keys() -> tuple[str, str]:
    return Q_A, Q_B
