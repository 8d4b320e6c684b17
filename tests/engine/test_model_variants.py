"""Config options of the supported families that change the model: the engine serves them as transformers
(with and without a PEFT adapter) does, or refuses what it cannot."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy

from loraplex.engine.errors import ModelLoadError
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter, make_tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's projections are fused in the model
# Phi-4-mini's shape of rope: LongRoPE over the leading three quarters of each head (16 dims: 12 rotate)
LONGROPE = {"partial_rotary_factor": 0.75, "max_position_embeddings": 512, "original_max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.8, 4.1, 6.0],
                             "long_factor": [4.0, 5.0, 6.0, 7.0, 8.0, 9.0], "original_max_position_embeddings": 128}}
PROMPT = [5, 17, 33, 80, 101, 7, 250, 31, 44, 12, 190, 66, 3, 71, 140, 9, 2, 11, 300, 1, 77, 91, 18, 240]
MAX_TOKENS = 8


def _hf(model_dir, adapter_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


@pytest.mark.parametrize("arch,config", [
    ("llama", {"attention_bias": True}),  # a bias on q, k, v and o
    ("llama", {"mlp_bias": True}),  # a bias on gate, up and down
    # sliding-window attention, the prompt and tokens running well past the window
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen3", {"attention_bias": True}),  # a bias on q, k, v and o, beside the q/k norms
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen3", {"head_dim": 8, "num_key_value_heads": 1}),  # heads narrower than hidden_size / heads, MQA
    ("phi3", {"sliding_window": 8}),
    ("phi3", {"partial_rotary_factor": 0.5}),
    ("phi3", LONGROPE),
], ids=["llama-attention-bias", "llama-mlp-bias", "mistral-window", "qwen2-window", "qwen3-attention-bias",
        "qwen3-window", "qwen3-narrow-heads-mqa", "phi3-window", "phi3-partial-rotary", "phi3-longrope"])
def test_variant_matches_transformers_and_peft(tmp_path, arch, config):
    model_dir = make_tiny_model(tmp_path / "m", arch, **config)
    targets = PHI3_ALL if arch == "phi3" else ALL
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=4, target_modules=targets, seed=3)
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, adapter=[None, str(adapter)], use_tqdm=False)
    for out, adapter_dir in zip(outs, (None, adapter), strict=True):
        expected = hf_greedy(model_dir, PROMPT, MAX_TOKENS, _hf(model_dir, adapter_dir))
        assert out.outputs[0].token_ids == expected, adapter_dir
    assert len(PROMPT) + MAX_TOKENS <= llm.engine.limits.max_model_len


@pytest.mark.parametrize("arch,config", [
    ("mistral", {"sliding_window": 40}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1}),
    ("phi3", {"sliding_window": 40}),
])
def test_sliding_window_models_serve_every_position(tmp_path, arch, config):
    # the engine attends over each layer's window: the window does not bound the context
    model_dir = make_tiny_model(tmp_path / "m", arch, **config)
    assert LLM(str(model_dir), num_kv_blocks=16, max_loras=0).engine.limits.max_model_len == 512
    assert LLM(str(model_dir), num_kv_blocks=16, max_loras=0, max_model_len=41).engine.limits.max_model_len == 41


def test_qwen2_without_sliding_layers_attends_over_whole_contexts(tmp_path):
    # use_sliding_window with max_window_layers past the last layer: transformers slides in no layer
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", use_sliding_window=True, sliding_window=40,
                                max_window_layers=2)
    llm = LLM(str(model_dir), num_kv_blocks=16, max_loras=0)
    assert llm.engine.limits.max_model_len == 512
    assert [attn.window for attn in llm.engine.runner.model.attention_layers] == [None, None]


def test_longrope_serves_its_original_positions_only(tmp_path):
    # Past original_max_position_embeddings transformers rotates a whole forward pass with the long factors,
    # so a token's rotation depends on how its sequence was split; the engine serves where the short factors hold.
    model_dir = make_tiny_model(tmp_path / "m", "phi3", **LONGROPE)
    assert LLM(str(model_dir), num_kv_blocks=16, max_loras=0).engine.limits.max_model_len == 128
    with pytest.raises(ValueError, match="exceeds the 128 positions"):
        LLM(str(model_dir), num_kv_blocks=16, max_loras=0, max_model_len=129)


@pytest.mark.parametrize("arch,scaling,message", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
     "rope scaling type 'yarn' is not supported"),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}, "rope scaling type 'dynamic' is not supported"),
])
def test_unsupported_rope_scaling_is_refused_before_loading(tmp_path, arch, scaling, message):
    model_dir = make_tiny_model(tmp_path / "m", arch, rope_scaling=scaling)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(model_dir), num_kv_blocks=16, max_loras=0)


@pytest.mark.parametrize("arch,config,targets", [
    ("qwen3", {}, ("q_proj", "k_proj", "v_proj")),
    ("phi3", {"partial_rotary_factor": 0.5}, ("qkv_proj",)),
])
def test_long_chunked_prompt_matches_peft(tmp_path, arch, config, targets):
    # 297 tokens prefilled in chunks of 64, past the short-context attention path: the q/k norms and the partial
    # rotation apply to chunks that attend over cached keys
    model_dir = make_tiny_model(tmp_path / "m", arch, **config)
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=4, target_modules=targets, seed=5)
    prompt = list(range(3, 300))
    llm = LLM(str(model_dir), num_kv_blocks=128, max_loras=1, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, adapter=str(adapter), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS, _hf(model_dir, adapter))
