"""Reading a config.json into the engine's ModelArch: the Qwen3 and Phi-3 facts, and clear refusals."""

from __future__ import annotations

import math

import pytest

from loraplex.engine.models.arch import ModelArch
from loraplex.engine.models.layers import rope_attention_scaling

QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
              "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000,
              "attention_bias": False, "tie_word_embeddings": True, "sliding_window": None}
PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144}


def test_qwen3():
    arch = ModelArch.from_hf_config(QWEN3_0_6B)
    assert (arch.head_dim, arch.q_size, arch.qk_norm, arch.qkv_bias, arch.o_bias) == (128, 2048, True, False, False)
    assert arch.sliding_window is None and arch.rotary_dim is None and arch.rope_scaling is None
    biased = ModelArch.from_hf_config({**QWEN3_0_6B, "attention_bias": True})
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, False)
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads
    assert ModelArch.from_hf_config({k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}).head_dim == 128


def test_phi3_longrope_as_the_checkpoints_write_it():
    scaling = {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}  # Phi-3-mini-128k's older name
    arch = ModelArch.from_hf_config({**PHI3, "rope_scaling": scaling})
    assert not arch.qk_norm and arch.rotary_dim is None and arch.sliding_window == 262144
    assert arch.rope_scaling["rope_type"] == "longrope" and arch.rope_short_positions == 4096
    assert rope_attention_scaling(arch.rope_scaling) == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    phi4_mini = ModelArch.from_hf_config({**PHI3, "partial_rotary_factor": 0.75, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 36, "long_factor": [2.0] * 36}})
    assert phi4_mini.rotary_dim == 72


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 10, "long_factor": [2.0] * 48}},
     "short_factor must be a list of 48 numbers"),
    ({"original_max_position_embeddings": None,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}},
     "needs original_max_position_embeddings"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in"),
    ({"partial_rotary_factor": 0.01}, "an even number of at least 2"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs a numeric factor"),
    ({"architectures": ["Phi3SmallForCausalLM"], "model_type": "phi3small"}, "unsupported architecture"),
])
def test_what_the_engine_does_not_compute_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config({**PHI3, **change})
