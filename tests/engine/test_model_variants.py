"""Config options of the supported families that change the model: the engine serves them as transformers
(with and without a PEFT adapter) does, or refuses what it cannot."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter, make_tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
], ids=["llama-attention-bias", "llama-mlp-bias", "mistral-window", "qwen2-window"])
def test_variant_matches_transformers_and_peft(tmp_path, arch, config):
    model_dir = make_tiny_model(tmp_path / "m", arch, **config)
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=4, target_modules=ALL, seed=3)
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
