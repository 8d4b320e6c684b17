"""Helpers shared by the adapter tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterValidationError, load_adapter


def refused(path, spec, code, *words, limits=None) -> AdapterValidationError:
    """Loading `path` is refused with `code`, and the message names each of `words`."""
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(path, spec, limits)
    assert info.value.code == code, str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
    return info.value


def peft_deltas(base_dir, adapter_dir) -> dict:
    """(layer, module) -> the dense update PEFT itself applies, for the adapter as PEFT loads it."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    from loraplex.adapters import TOP_LEVEL

    deltas = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and ("default" in module.lora_A or "default" in module.lora_embedding_A):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else TOP_LEVEL
            delta = module.get_delta_weight("default").detach()
            # PEFT gives an embedding's update in the embedding's layout, [vocab, hidden]
            deltas[(layer, parts[-1])] = delta.t() if parts[-1] == "embed_tokens" else delta
    return deltas


def logits_peft_and_canonical(base_dir, adapter_dir, adapter, ids):
    """Logits of PEFT's own forward pass with the adapter (in eval mode, as served), and of the base model
    with the canonical weights' updates added to its projections."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()

    with torch.no_grad():
        expected = PeftModel.from_pretrained(base(), str(adapter_dir)).eval()(ids).logits
        merged = base()
        for (layer, module), w in adapter.weights.items():
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            getattr(getattr(merged.model.layers[layer], parent), module).weight += w.delta()
        return expected, merged(ids).logits


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
