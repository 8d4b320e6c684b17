"""The CPU decoder stack (one C++ call for a step's layers) gives the module path's results bit for bit, with
and without adapters in the step, and steps it does not take fall back to the modules."""

from __future__ import annotations

import pytest

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernels import linear_cpu, ops_cpu
from loraplex.testing import make_peft_adapter, make_tiny_model

pytestmark = pytest.mark.skipif(
    linear_cpu.linear_address() is None or not ops_cpu.available(),
    reason="the decoder stack needs the compiled CPU GEMM (AVX2 or AVX-512) and fused ops",
)

PROMPTS = [[5, 17, 33, 80, 101, 7], [9, 250, 31], [44, 44, 12, 190, 66, 3, 71, 140, 9, 2, 11], [300, 1], [8] * 40]


@pytest.fixture
def stack_calls(monkeypatch):
    calls = []
    real = ops_cpu.decoder_stack

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(ops_cpu, "decoder_stack", counted)
    return calls


def _run(model_dir, monkeypatch, *, stack: bool, adapters=None, **kwargs):
    monkeypatch.setenv("LORAPLEX_CPU_DECODER_STACK", "1" if stack else "0")
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, enable_prefix_caching=False, **kwargs)
    assert (llm.engine.runner.model.model._stack is not None) == stack
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, adapter=adapters, use_tqdm=False)
    return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in outs]


@pytest.fixture(scope="module")
def tiny_windowed_qwen2_dir(tmp_path_factory):
    """Qwen2 with a full-attention layer and a sliding one (window 6, shorter than most prompts)."""
    return make_tiny_model(tmp_path_factory.mktemp("windowed"), "qwen2", use_sliding_window=True, sliding_window=6,
                           max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_partial_rotary_phi3_dir(tmp_path_factory):
    """Phi-3 rotating the leading half of each head only."""
    return make_tiny_model(tmp_path_factory.mktemp("partial"), "phi3", partial_rotary_factor=0.5)


@pytest.fixture(scope="module")
def tiny_attention_bias_llama_dir(tmp_path_factory):
    """Llama with attention_bias: biases on q, k, v and o_proj."""
    return make_tiny_model(tmp_path_factory.mktemp("attn_bias"), "llama", attention_bias=True)


@pytest.fixture(scope="module")
def tiny_mlp_bias_llama_dir(tmp_path_factory):
    """Llama with mlp_bias: biases on gate, up and down."""
    return make_tiny_model(tmp_path_factory.mktemp("mlp_bias"), "llama", mlp_bias=True)


@pytest.mark.parametrize("arch", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_tied_dir", "tiny_windowed_qwen2_dir",
                                  "tiny_phi3_dir", "tiny_qwen3_dir", "tiny_partial_rotary_phi3_dir",
                                  "tiny_attention_bias_llama_dir", "tiny_mlp_bias_llama_dir"])
def test_same_tokens_and_logprobs_as_the_modules(arch, request, monkeypatch, stack_calls):
    # qwen2: biased qkv; tied: the head is the embedding; windowed: each layer's window is the kernel's argument;
    # phi3: loaded from fused checkpoint projections; qwen3: per-head q/k norms (head_dim 32, wider than
    # hidden / heads); partial rotary: half of each head rotates; attention_bias: o_proj's bias too; mlp_bias
    model_dir = request.getfixturevalue(arch)
    stacked = _run(model_dir, monkeypatch, stack=True, max_loras=0)
    # the short prefill (62 tokens) and every decode step (5 rows) took it
    assert stack_calls == [sum(map(len, PROMPTS))] + [len(PROMPTS)] * 9
    assert stacked == _run(model_dir, monkeypatch, stack=False, max_loras=0)


def test_same_results_with_adapters_mixed_in_the_step(tiny_llama_dir, tmp_path, monkeypatch, stack_calls):
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dirs = [
        make_peft_adapter(tiny_llama_dir, tmp_path / "a0", r=8, target_modules=every, seed=0),
        make_peft_adapter(tiny_llama_dir, tmp_path / "a1", r=32, target_modules=("q_proj", "v_proj"), seed=1),
        make_peft_adapter(tiny_llama_dir, tmp_path / "a2", r=4, target_modules=("down_proj",), use_rslora=True,
                          seed=2),
    ]
    adapters = [str(dirs[0]), str(dirs[1]), None, str(dirs[2]), str(dirs[0])]
    kwargs = dict(max_loras=3, max_cpu_loras=3, adapter_store=str(tmp_path / "store"))
    stacked = _run(tiny_llama_dir, monkeypatch, stack=True, adapters=adapters, **kwargs)
    assert stack_calls
    assert stacked == _run(tiny_llama_dir, monkeypatch, stack=False, adapters=adapters, **kwargs)
    base_only = _run(tiny_llama_dir, monkeypatch, stack=True, max_loras=0)
    assert stacked[2] == base_only[2] and stacked[0] != base_only[0]  # the adapters did change their rows


def test_long_prefills_take_the_modules(tiny_llama_dir, monkeypatch, stack_calls):
    monkeypatch.setenv("LORAPLEX_CPU_DECODER_STACK", "1")
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, enable_prefix_caching=False, max_loras=0)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * 300}, {"prompt_token_ids": [9] * 300}], params, use_tqdm=False)
    assert stack_calls == [2]  # the 600-token prefill ran the modules, the one decode step the stack


def test_phi3_with_fused_adapters_mixed_in_the_step(tiny_phi3_dir, tmp_path, monkeypatch, stack_calls):
    dirs = [
        make_peft_adapter(tiny_phi3_dir, tmp_path / "a0", r=8, seed=0,
                          target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        make_peft_adapter(tiny_phi3_dir, tmp_path / "a1", r=4, target_modules=("qkv_proj",), seed=1),
    ]
    adapters = [str(dirs[0]), None, str(dirs[1]), str(dirs[0]), None]
    kwargs = dict(max_loras=2, max_cpu_loras=2, adapter_store=str(tmp_path / "store"))
    stacked = _run(tiny_phi3_dir, monkeypatch, stack=True, adapters=adapters, **kwargs)
    assert stack_calls
    assert stacked == _run(tiny_phi3_dir, monkeypatch, stack=False, adapters=adapters, **kwargs)


@pytest.mark.parametrize("arch", ["tiny_qwen3_dir", "tiny_partial_rotary_phi3_dir", "tiny_attention_bias_llama_dir",
                                  "tiny_mlp_bias_llama_dir"])
def test_variants_with_adapters_mixed_in_the_step(arch, request, tmp_path, monkeypatch, stack_calls):
    # the LoRA deltas go in after each projection's bias, before the q/k norms and the rotation
    model_dir = request.getfixturevalue(arch)
    every = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if "phi3" in arch else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dirs = [
        make_peft_adapter(model_dir, tmp_path / "a0", r=8, target_modules=every, seed=0),
        make_peft_adapter(model_dir, tmp_path / "a1", r=4, target_modules=every[:1], seed=1),
    ]
    adapters = [str(dirs[0]), None, str(dirs[1]), str(dirs[0]), None]
    kwargs = dict(max_loras=2, max_cpu_loras=2, adapter_store=str(tmp_path / "store"))
    stacked = _run(model_dir, monkeypatch, stack=True, adapters=adapters, **kwargs)
    assert stack_calls == [sum(map(len, PROMPTS))] + [len(PROMPTS)] * 9
    assert stacked == _run(model_dir, monkeypatch, stack=False, adapters=adapters, **kwargs)
    base_only = _run(model_dir, monkeypatch, stack=True, max_loras=0)
    assert stacked[1] == base_only[1] and stacked[0] != base_only[0]  # the adapters did change their rows


def test_phi3_longrope_takes_the_stack(tmp_path, monkeypatch, stack_calls):
    # LongRoPE's attention factor scales the cos/sin tables both paths read: the stack expresses it exactly
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)], "long_factor": [4.0] * 8,
               "original_max_position_embeddings": 128}
    model_dir = make_tiny_model(tmp_path / "m", "phi3", max_position_embeddings=512,
                                original_max_position_embeddings=128, rope_scaling=scaling)
    stacked = _run(model_dir, monkeypatch, stack=True, max_loras=0)
    assert stack_calls
    assert stacked == _run(model_dir, monkeypatch, stack=False, max_loras=0)
