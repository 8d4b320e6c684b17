"""BaseModelSpec from HF configs: shapes with GQA, PEFT names, fused projections split into slices."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.adapters import (
    MODULES,
    AdapterValidationError,
    BaseModelSpec,
    ErrorCode,
    ModuleShape,
    ModuleSlice,
    load_adapter,
)

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


def test_gqa_shapes():
    spec = BaseModelSpec.from_config(SMOLLM2)
    assert spec.num_layers == 30 and spec.hidden_size == 576
    assert spec.modules["q_proj"] == ModuleShape(576, 576)
    assert spec.modules["k_proj"] == spec.modules["v_proj"] == ModuleShape(576, 192)
    assert spec.modules["o_proj"] == ModuleShape(576, 576)
    assert spec.modules["gate_proj"] == spec.modules["up_proj"] == ModuleShape(576, 1536)
    assert spec.modules["down_proj"] == ModuleShape(1536, 576)
    assert tuple(spec.peft_modules) == MODULES
    assert spec.module_path(3, "down_proj") == "model.layers.3.mlp.down_proj"


def test_explicit_head_dim():
    spec = BaseModelSpec.from_config({**SMOLLM2, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    assert spec.modules["q_proj"] == ModuleShape(576, 9 * 128)
    assert spec.modules["k_proj"] == ModuleShape(576, 3 * 128)
    assert spec.modules["o_proj"] == ModuleShape(9 * 128, 576)


def test_from_transformers_config_matches_dir(tiny_qwen2_dir):
    from transformers import AutoConfig

    assert BaseModelSpec.from_config(AutoConfig.from_pretrained(tiny_qwen2_dir)) == \
        BaseModelSpec.from_model_dir(tiny_qwen2_dir)


def test_model_type_fallback_and_unsupported():
    assert BaseModelSpec.from_config({**SMOLLM2, "architectures": None, "model_type": "mistral"}).architecture \
        == "MistralForCausalLM"
    with pytest.raises(AdapterValidationError) as info:
        BaseModelSpec.from_config({**SMOLLM2, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert info.value.code == ErrorCode.ARCHITECTURE_UNSUPPORTED and "GPT2LMHeadModel" in str(info.value)
    with pytest.raises(AdapterValidationError) as info:
        BaseModelSpec.from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})
    assert info.value.code == ErrorCode.BASE_MODEL_MISMATCH


def test_qwen3_without_head_dim_has_transformers_default():
    # Qwen3Config's head_dim defaults to 128, not hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128)
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 8, "intermediate_size": 3072, "num_hidden_layers": 2}
    spec = BaseModelSpec.from_config(config)
    assert spec.modules["q_proj"] == ModuleShape(1024, 2048) and spec.modules["o_proj"] == ModuleShape(2048, 1024)


def test_phi3_fused_slices():
    spec = BaseModelSpec.from_config({**SMOLLM2, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})
    assert spec.peft_modules["qkv_proj"] == (ModuleSlice("q_proj", 0, 576), ModuleSlice("k_proj", 576, 768),
                                             ModuleSlice("v_proj", 768, 960))
    assert spec.peft_modules["gate_up_proj"] == (ModuleSlice("gate_proj", 0, 1536),
                                                 ModuleSlice("up_proj", 1536, 3072))
    assert spec.peft_shape("qkv_proj") == ModuleShape(576, 960)


@pytest.fixture(scope="module")
def tiny_phi3_dir(tmp_path_factory):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, max_position_embeddings=128)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_phi3")
    Phi3ForCausalLM(config).save_pretrained(out)
    return out


def test_fused_adapter_splits_into_peft_equivalent_slices(tiny_phi3_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.testing import make_peft_adapter

    adapter_dir = make_peft_adapter(tiny_phi3_dir, tmp_path / "lora", r=4,
                                    target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    spec = BaseModelSpec.from_model_dir(tiny_phi3_dir)
    adapter = load_adapter(adapter_dir, spec)
    assert set(adapter.target_modules) == set(MODULES) and len(adapter.weights) == 14
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_phi3_dir), adapter_dir)
    layers = peft_model.base_model.model.model.layers
    for layer in range(2):
        fused = {"qkv_proj": layers[layer].self_attn.qkv_proj, "gate_up_proj": layers[layer].mlp.gate_up_proj,
                 "o_proj": layers[layer].self_attn.o_proj, "down_proj": layers[layer].mlp.down_proj}
        for name, module in fused.items():
            delta = module.get_delta_weight("default").detach()
            for s in spec.peft_modules[name]:
                torch.testing.assert_close(adapter.weights[(layer, s.module)].delta(), delta[s.start:s.stop],
                                           rtol=1e-5, atol=1e-6)


def test_separate_names_refused_on_fused_model(tiny_phi3_dir, llama_adapter_dir):
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(llama_adapter_dir, BaseModelSpec.from_model_dir(tiny_phi3_dir))
    assert info.value.code == ErrorCode.UNKNOWN_TARGET_MODULE and "qkv_proj" in str(info.value)


def test_adapter_for_another_base_model(tiny_llama_dir, tmp_path, llama_adapter_dir):
    from loraplex.testing import make_tiny_model

    wider = BaseModelSpec.from_model_dir(make_tiny_model(tmp_path / "wide", "llama", hidden_size=96))
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(llama_adapter_dir, wider)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH and "96" in str(info.value)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    shallower = BaseModelSpec.from_config({**config, "num_hidden_layers": 1})
    with pytest.raises(AdapterValidationError) as info:
        load_adapter(llama_adapter_dir, shallower)
    assert info.value.code == ErrorCode.LAYER_OUT_OF_RANGE and "layers.1" in str(info.value) and "1 layers" in str(info.value)
