"""Canonical weights reproduce the delta PEFT itself applies, module by module."""

from __future__ import annotations

import pytest
import torch
from adapter_helpers import peft_deltas

from loraplex.adapters import MODULES, BaseModelSpec, load_adapter
from loraplex.testing import make_peft_adapter

CASES = [
    pytest.param("tiny_llama_dir", dict(r=8, target_modules=MODULES), id="llama-r8-all"),
    pytest.param("tiny_llama_dir", dict(r=16, target_modules=("q_proj", "v_proj"), use_rslora=True,
                                        lora_alpha=8), id="llama-r16-qv-rslora"),
    pytest.param("tiny_qwen2_dir", dict(r=4, target_modules=("k_proj", "o_proj", "down_proj")), id="qwen2-r4"),
    pytest.param("tiny_qwen2_dir", dict(r=32, target_modules=MODULES, use_rslora=True),
                 id="qwen2-r32-all-rslora"),
    pytest.param("tiny_llama_dir", dict(r=8, target_modules=("q_proj", "gate_proj"), layers_to_transform=[1],
                                        rank_pattern={"gate_proj": 4}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3}),
                 id="llama-patterns-layer1"),
    # PEFT's pattern-key rule: a key matches the end of a module path after a dot ("proj" matches no "q_proj"),
    # "^" only from the start; the first key in the file that matches wins (PEFT saves the keys sorted)
    pytest.param("tiny_llama_dir", dict(r=8, target_modules=MODULES,
                                        rank_pattern={"^model.layers.0.self_attn.q_proj": 2, "layers.1.*": 6,
                                                      r"mlp\.\w+_proj": 4},
                                        alpha_pattern={"k_proj": 7, "layers.1.*": 3, "proj": 50}),
                 id="llama-pattern-keys"),
    # a module named in full is wrapped whatever layers_to_transform says (PEFT's exact-name rule)
    pytest.param("tiny_llama_dir", dict(r=4, target_modules=["model.layers.0.self_attn.q_proj", "v_proj"],
                                        layers_to_transform=[1]), id="llama-full-name-outside-layers"),
]


@pytest.mark.parametrize(("base_fixture", "kwargs"), CASES)
def test_canonical_delta_equals_peft_delta(base_fixture, kwargs, request, tmp_path):
    base_dir = request.getfixturevalue(base_fixture)
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "lora", seed=3, **kwargs)
    adapter = load_adapter(adapter_dir, BaseModelSpec.from_model_dir(base_dir))
    expected = peft_deltas(base_dir, adapter_dir)
    assert set(adapter.weights) == set(expected)
    for key, delta in expected.items():
        w = adapter.weights[key]
        assert w.a.dtype == w.b.dtype == torch.float32
        assert w.a.is_contiguous() and w.b.is_contiguous()
        assert delta.abs().max() > 1e-3  # the adapter really changes this module
        torch.testing.assert_close(w.delta(), delta, rtol=1e-5, atol=1e-6)
    assert set(adapter.target_modules) <= set(MODULES)


def test_made_adapters_change_the_model(tiny_llama_dir, llama_adapter_dir):
    """make_peft_adapter's random B must move the logits enough for token comparisons to mean something."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        base = model(ids).logits
        adapted = PeftModel.from_pretrained(model, str(llama_adapter_dir))(ids).logits
    assert (adapted - base).abs().max() > 0.5
    assert not torch.equal(adapted.argmax(-1), base.argmax(-1))


def test_limits_are_checked_and_follow_settings():
    from loraplex.adapters import AdapterLimits
    from loraplex.config import Settings

    with pytest.raises(ValueError, match="max_rank"):
        AdapterLimits(max_rank=0)
    limits = AdapterLimits.from_settings(Settings(max_lora_rank=32, max_upload_bytes=1000, max_adapter_members=5))
    assert (limits.max_rank, limits.max_archive_bytes, limits.max_members) == (32, 1000, 5)
